"""The model floor that the engine, the trainer and the server stand on: the architecture and its
Hugging Face files (config, safetensors, tokenizer, chat template), packed training rows, weight
streams, and the text formats of tool calls. It knows nothing of KV pages, sandboxes or runs."""
