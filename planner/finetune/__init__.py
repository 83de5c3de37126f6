"""Fine-tuning plans: which parameters train (``config``) and how the model description changes
when adapters train on a frozen base (``lora``: LoRA as peft runs it)."""
