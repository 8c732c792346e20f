"""The DeepSeek-V3 family: multi-head latent attention, group-limited routed experts, MTP."""
