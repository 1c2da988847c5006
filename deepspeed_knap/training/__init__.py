"""Training as library code: :class:`~deepspeed_knap.training.trainer.Trainer` runs a fine-tuning job of
any registered model family from :class:`~deepspeed_knap.training.arguments.TrainingArguments`
(``examples/train_dit.py`` is its command line)."""
