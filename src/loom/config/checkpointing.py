"""The checkpoint flags: saving, keeping, resuming (what a resume may change), the Hugging
Face folder after training. A section of the job (`loom.config.job`), declared apart from
`schema.py` to keep each module to one screenful of sections."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config.declare import FOREVER_S, flag


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_interval: int = flag(0, "save a checkpoint every N steps and at the end "
                                    "(0 = no checkpoints)")
    keep_checkpoints: int = flag(2, "keep the newest K complete checkpoints", ge=1)
    save_hf: bool = flag(False, "after training, write the final checkpoint as a Hugging Face "
                         "folder, <outdir>/hf (what loom export writes, checked the same way)")
    async_checkpoint: bool = flag(False, "write checkpoints in a background thread")
    resume: str | None = flag(None, "continue from the latest checkpoint in --outdir (bare "
                              "flag: there must be one; 'auto': if there is one) or from a "
                              "checkpoint folder", type=str, const="latest")
    resume_new_data: bool = flag(False, "resume with a --dataset (a mixture's sources or "
                                 "weights too), --tokenizer-name, --hf-split or "
                                 "--hf-text-column other than the checkpoint's (without it a "
                                 "difference stops the run)")
    resume_change_model: bool = flag(False, "resume with model flags that change what the "
                                     "model computes but no weight's shape (--rope-theta, "
                                     "--norm-eps, --top-k, ...; without it a difference stops "
                                     "the run)")
    sigterm_grace_s: float = flag(25.0, "on SIGTERM, save a final checkpoint only if the last "
                                  "save took at most this long (schedulers kill ~30 s later)",
                                  le=FOREVER_S)
