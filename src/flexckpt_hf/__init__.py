"""flexckpt inside the transformers ``Trainer`` (5.x): one line, no pickle.

    from flexckpt_hf import FlexTrainer

    trainer = FlexTrainer(model=model, args=args, train_dataset=ds)   # in place of Trainer(...)
    trainer.train(resume_from_checkpoint=True)

Package boundary: this package is the only one that imports transformers
(transformers -> flexckpt_hf -> flexckpt; never back). See docs/integrations/transformers.md.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexckpt.integration import require

require("flexckpt_hf", "transformers", "hf")  # before any import of it: a missing extra is named

from flexckpt_hf.trainer import FlexTrainer, folder_step

__all__ = ["__version__", "FlexTrainer", "folder_step"]
