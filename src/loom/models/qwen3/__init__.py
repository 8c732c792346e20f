"""The Qwen3 families: Llama and MoE configurations with their Hugging Face adapters."""
