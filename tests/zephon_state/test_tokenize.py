"""zephon_state tokenizers: the bundled GPT-2 BPE, local tokenizer.json files, the worker pool."""
import hashlib
import re
import threading
import time
from importlib import resources

import pytest

from zephon_state import TokenizerNotFound, load_tokenizer
from zephon_state.tokenize import TokenizerPool


def test_bundled_gpt2_gives_the_standard_ids_without_network():
    tok = load_tokenizer("gpt2")
    assert tok.tokenizer.encode("Hello world, this is a test.").ids == [15496, 995, 11, 428, 318, 257, 1332, 13]
    assert tok.eos_id == 50256
    assert tok.tokenizer.get_vocab_size() == 50257
    assert tok.tokenizer.decode([15496, 995, 11, 428, 318, 257, 1332, 13]) == "Hello world, this is a test."


def test_bundled_corpus_bpe_gives_its_recorded_ids_and_ends_documents_with_its_last_id():
    """The 4,096-token BPE of the ``blocks`` preset: the ids its provenance records, its
    end-of-document token the vocabulary's last id, whose text in a document stays text, and
    zephon's cuts at spaces allowed (its JSON passes ``cuts_at_spaces``)."""
    tok = load_tokenizer("corpus-bpe-4096")
    assert tok.tokenizer.get_vocab_size(with_added_tokens=True) == 4096 and tok.eos_id == 4095 and tok.cuts
    ids = [39, 276, 439, 2026, 11, 518, 339, 260, 1276, 13]
    assert tok.tokenizer.encode("Hello world, this is a test.").ids == ids
    assert tok.tokenizer.decode(ids) == "Hello world, this is a test."
    flat, lengths = tok.encode(["<|endoftext|>", ""])
    assert flat.tolist() == [27, 91, 962, 719, 818, 91, 29, 4095, 4095] and lengths.tolist() == [8, 1]
    assert tok.sha256 == "91dfd2a9ea12540e8c8665de1c381ec982011e2637bbcb78d7128a979b06c4db"  # what fingerprints record


@pytest.mark.parametrize("bundled,files", [("gpt2", ("encoder.json", "vocab.bpe")),
                                           ("corpus-bpe-4096", ("tokenizer.json",))])
def test_bundled_vocabulary_files_match_the_sha256_in_their_provenance(bundled, files):
    folder = resources.files("zephon_state") / "assets" / bundled
    provenance = (folder / "PROVENANCE.md").read_text()
    for name in files:
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(name)}` \| `{digest}`", provenance), name


def test_encode_ends_every_document_with_eos_and_treats_special_token_text_as_text():
    flat, lengths = load_tokenizer("gpt2").encode(["Hello world", "", "<|endoftext|>"])
    assert flat.dtype.name == "int32" and lengths.tolist() == [3, 1, 8]
    assert flat.tolist() == [15496, 995, 50256, 50256, 27, 91, 437, 1659, 5239, 91, 29, 50256]


def test_a_local_tokenizer_json_file_or_folder_loads_the_same_tokenizer(tmp_path):
    gpt2 = load_tokenizer("gpt2")
    gpt2.tokenizer.save(str(tmp_path / "tokenizer.json"))
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        local = load_tokenizer(spec)
        assert local.sha256 == gpt2.sha256
        assert local.eos_id == 50256
        assert local.encode(["Hello world, this is a test."])[0].tolist() == [15496, 995, 11, 428, 318, 257, 1332, 13, 50256]


def test_an_unknown_tokenizer_path_names_the_id_and_the_fix():
    with pytest.raises(TokenizerNotFound, match=r"'/nonexistent/tokenizer.json' is not bundled .*pass tokenizer_id='gpt2'"):
        load_tokenizer("/nonexistent/tokenizer.json")


def test_pool_futures_keep_submission_order_whatever_order_workers_finish_in():
    pool = TokenizerPool(2)
    finished = []
    lock = threading.Lock()

    def work(i, delay):
        time.sleep(delay)
        with lock:
            finished.append(i)
        return i

    futures = [pool.submit(work, 0, 0.2), pool.submit(work, 1, 0.0)]
    assert [f.result(timeout=5) for f in futures] == [0, 1]
    assert finished == [1, 0]
    pool.close()


def test_accumulator_hands_out_documents_in_input_order_when_a_later_chunk_finishes_first():
    from zephon_state import InMemory
    from zephon_state.accumulator import Accumulator
    from zephon_state.deal import SourceReader
    from zephon_state.mix import exact_shares
    from zephon_state.mixture import Plan
    from zephon_state.source import IoOptions

    texts = [f"document {i} " + "text " * i for i in range(8)]
    docs = InMemory(texts).load("text", IoOptions(), "raise")
    plan = Plan(("m",), (docs,), exact_shares([1.0]), (0.25,), 0, 0)
    gpt2 = load_tokenizer("gpt2")
    calls = []

    class SlowFirstCall:
        eos_id, cuts = gpt2.eos_id, False

        def encode(self, batch, eos=None):
            calls.append(len(calls))
            if len(calls) == 1:
                time.sleep(0.3)
            out = gpt2.encode(batch, eos)
            finished.append(batch[0])
            return out

    finished = []
    pool = TokenizerPool(4)
    acc = Accumulator(SourceReader(plan, 0, 0, 1, 0, 0), SlowFirstCall(), pool, chunk_bytes=1, readahead_bytes=10_000)
    acc.start_readahead()
    got = [acc.next_document() for _ in range(8)]
    pool.close()
    order = [plan.order(0, 0)[i] for i in range(8)]
    assert finished[0] != texts[order[0]]  # a later chunk really did finish first
    for doc, i in zip(got, order):
        assert doc.tokens.tolist() == gpt2.encode([texts[i]])[0].tolist()
    assert [d.index for d in got] == list(range(8))


def test_accumulator_tokenizes_only_what_is_asked_for_until_its_readahead_starts():
    from concurrent.futures import Future

    from zephon_state import InMemory
    from zephon_state.accumulator import Accumulator
    from zephon_state.deal import SourceReader
    from zephon_state.mix import exact_shares
    from zephon_state.mixture import Plan
    from zephon_state.source import IoOptions

    texts = [f"document {i} " + "text " * i for i in range(40)]
    plan = Plan(("m",), (InMemory(texts).load("text", IoOptions(), "raise"),), exact_shares([1.0]), (0.25,), 0, 0)
    submitted = []

    class InlinePool:
        def submit(self, fn, batch, *args):
            submitted.append(len(batch))
            future = Future()
            future.set_result(fn(batch, *args))
            return future

    acc = Accumulator(SourceReader(plan, 0, 0, 1, 0, 0), load_tokenizer("gpt2"), InlinePool(), chunk_bytes=1,
                      readahead_bytes=100)
    acc.next_document()
    acc.next_document()
    assert submitted == [1, 1]  # a replay: the documents asked for, nothing ahead
    acc.start_readahead()
    ahead = len(submitted) - 2
    assert ahead >= 2 and acc._ahead >= 100  # now at least readahead_bytes are submitted ahead


@pytest.mark.parametrize("bundled", ["gpt2", "corpus-bpe-4096"])
def test_parts_cut_at_spaces_between_letters_tokenize_like_the_whole_document_on_both_corpora(bundled):
    """The claim resume points rest on (cursor version 2): every twentieth document of each shipped
    corpus, cut at every space between two ASCII letters, gives exactly the whole document's ids,
    with each bundled tokenizer."""
    from pathlib import Path

    from zephon_state import JsonLines
    from zephon_state.source import IoOptions
    from zephon_state.tokenize import next_cut

    tok = load_tokenizer(bundled)
    assert tok.cuts
    corpus = Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus"
    cuts_seen = 0
    for name in ("kjv", "python_stdlib"):
        texts = list(JsonLines(str(corpus / f"{name}.jsonl.zst")).load("text", IoOptions(), "raise").texts)[::20]
        whole, _ = tok.encode(texts)
        parts, eos = [], []
        for text in texts:
            start = 0
            while True:
                stop = next_cut(text, start, 1)
                parts.append(text[start:stop])
                eos.append(stop == len(text))
                if stop == len(text):
                    break
                start = stop
        cut, lengths = tok.encode(parts, eos)
        assert cut.tolist() == whole.tolist(), name
        assert len(lengths) == len(parts) and int((lengths == 0).sum()) == 0
        cuts_seen += len(parts) - len(texts)
    assert cuts_seen > 25_000


def test_only_tokenizers_whose_cuts_keep_the_tokens_are_read_in_parts():
    import json

    from zephon_state.tokenize import cuts_at_spaces

    gpt2 = load_tokenizer("gpt2")
    spec = json.loads(gpt2.tokenizer.to_str())
    assert gpt2.cuts and cuts_at_spaces(spec)
    assert gpt2.encode(["ab cd", "ab cd"], [False, True])[0].tolist() == [397, 22927, 397, 22927, 50256]
    variants = {
        "normalizer": {"normalizer": {"type": "Lowercase"}},
        "metaspace": {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                                        "split": True}},
        "dropout": {"model": {**spec["model"], "dropout": 0.1}},
        "spaced_added_token": {"added_tokens": [{"id": 50257, "content": "a b", "single_word": False, "lstrip": False,
                                                 "rstrip": False, "normalized": False, "special": False}]},
    }
    for name, change in variants.items():
        assert not cuts_at_spaces({**spec, **change}), name
