"""The Llama family: model, parallel plan, Hugging Face adapter, spec."""
