"""Training as library code: :class:`~deepspeed_knap.training.trainer.Trainer` runs a fine-tuning job of
any registered model family from :class:`~deepspeed_knap.training.arguments.TrainingArguments`
(``examples/train_dit.py`` is its command line).

    from deepspeed_knap.training import Trainer, TrainingArguments
"""

from deepspeed_knap.training.arguments import TrainingArguments, add_training_arguments
from deepspeed_knap.training.trainer import Trainer, TrainingError

__all__ = ["Trainer", "TrainingArguments", "TrainingError", "add_training_arguments"]
