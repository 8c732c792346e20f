"""Hugging Face interop above the parallel layer: a model's config.json fetched once per
node (`model_config`), pretrained weights read into a sharded model (`load`, through a
family's adapter: `checkpoint`), and export (`export*`, PEFT adapters in `peft`). The
readers the lower layers need stay below them (`models/hf_folder.py`, the one reader of a
Hub folder; `data/hub.py`, Hub reachability), since `data` and `models` cannot import a
package that imports them; each family's own adapter stays in its folder."""

import loom.families  # noqa: F401  (loom's families register: every command here builds models)
