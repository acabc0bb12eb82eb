"""flexckpt for Hugging Face Accelerate (1.16): what replaces ``save_state`` / ``load_state``.

    from flexckpt_accelerate import AcceleratorCheckpoint

    ckpt = AcceleratorCheckpoint(accelerator, "runs/r1/ckpt", keep_last=2)   # after prepare()
    step = ckpt.load()                                  # instead of accelerator.load_state(...)
    ckpt.save(step)                                     # instead of accelerator.save_state(...)

Package boundary: this package is the only one that imports accelerate
(accelerate -> flexckpt_accelerate -> flexckpt; never back). See docs/integrations/accelerate.md.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexckpt.integration import require

require("flexckpt_accelerate", "accelerate", "accelerate")  # before any import of it: a missing extra is named

from flexckpt_accelerate.state import AcceleratorCheckpoint

__all__ = ["__version__", "AcceleratorCheckpoint"]
