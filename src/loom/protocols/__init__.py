"""The interfaces features implement to plug into a run without the trainer knowing them:
model converters (before parallelization) and step hooks (after the optimizer step). They sit
below every package that implements them (numerics, parallel, lora) and the trainer that
calls them, so dependencies point down."""
