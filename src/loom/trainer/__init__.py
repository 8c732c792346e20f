"""The training loop: the trainer, one step and its executors, evaluation, the optimizer,
extension points."""
