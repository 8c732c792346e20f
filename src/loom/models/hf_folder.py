"""The one reader of Hugging Face model folders: every command that opens one goes here first.

A folder from the Hub or a colleague is input from a stranger, and the libraries that read
it trust it: the safetensors reader raises its own errors on a header that lies, transformers
builds whatever sizes config.json names (a hidden size whose storage overflows, zero heads,
a string where an int belongs) and unpickles `pytorch_model.bin`. So before any of them sees
the folder, this module checks it as data, and a bad one is one `ConfigError` naming the file
and the field:

- config.json: at most `MAX_CONFIG_BYTES`, nested at most `MAX_CONFIG_DEPTH` deep, the shape
  fields of the right type and inside a range, and the model they describe small enough that
  no byte count overflows int64;
- safetensors files: the header length inside the file, every tensor of a known dtype, its
  bytes (shape x dtype size) equal to its offsets, the tensors tiling the data with no overlap
  or gap (what the safetensors reader itself requires, checked before it runs);
- the shard index: a map of tensor names to plain file names inside the folder, each tensor in
  the shard named for it;
- pickled weights (`pytorch_model.bin`, ...) are never loaded: a folder holding only those is
  refused.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.errors import ConfigError
from loom.safe_io import json_depth, open_regular, read_json_capped, regular_size

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index",
           "tf_model.h5", "flax_model.msgpack")
"""Weight files loom never loads: unpickling runs code, and the others are not torch's."""

MAX_CONFIG_BYTES = 4 << 20
"""A real config.json is a few KB (a multimodal one with its sub-configs ~100 KB)."""
MAX_CONFIG_DEPTH = 32
"""Nesting deeper than this is crafted (real configs nest 3-4 deep); transformers copies
configs recursively and would end in a RecursionError."""
MAX_INDEX_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20
"""The safetensors format's own limit on a header."""
MAX_DIMS = 8
INT64_MAX = 2**63 - 1

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
"""Element sizes of the safetensors dtypes torch reads."""

INT_RANGES = {"hidden_size": (1, 2**20), "intermediate_size": (1, 2**22),
              "num_hidden_layers": (1, 2**12), "num_attention_heads": (1, 2**12),
              "num_key_value_heads": (1, 2**12), "head_dim": (1, 2**14),
              "vocab_size": (1, 2**25), "max_position_embeddings": (1, 2**28),
              "num_experts": (0, 2**14), "num_local_experts": (0, 2**14),
              "num_experts_per_tok": (0, 2**14), "moe_intermediate_size": (0, 2**22),
              "sliding_window": (1, 2**28), "max_window_layers": (0, 2**12),
              "n_embd": (1, 2**20), "n_layer": (1, 2**12), "n_head": (1, 2**12),
              "n_positions": (1, 2**28), "num_layers": (1, 2**12)}
"""Size fields (where present; `None` allowed where transformers derives them) and the
ranges a real model stays in: the largest released models are ~30x below each bound.
Expert fields may be 0 (dense configs of MoE-capable architectures write that)."""
NULLABLE = frozenset({"num_key_value_heads", "head_dim", "sliding_window", "num_experts",
                      "num_local_experts", "moe_intermediate_size", "max_window_layers"})
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
         "norm_topk_prob")
STRINGS = ("model_type", "hidden_act", "torch_dtype", "dtype")
MAPS = ("rope_scaling", "rope_parameters", "text_config")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checked safetensors file, as its header declares it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class HFFolder:
    """A checked Hugging Face folder: its config and every tensor its safetensors hold."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def stored_elements(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())


def bad(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}")


def check_fields(path: Path, c: dict[str, Any], prefix: str = "") -> None:
    """The shape fields of one config table (and its `text_config`): types and ranges."""
    for name, (low, high) in INT_RANGES.items():
        if name not in c or (c[name] is None and name in NULLABLE):
            continue
        value = c[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad(path, f"{prefix}{name} is {value!r}, not an integer")
        if not low <= value <= high:
            raise bad(path, f"{prefix}{name} is {value}, outside [{low}, {high:,}]")
    for name in POSITIVE_FLOATS:
        value = c.get(name)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                                  or not math.isfinite(value) or value <= 0):
            raise bad(path, f"{prefix}{name} is {value!r}, not a finite number > 0")
    for names, kind, label in ((BOOLS, bool, "true or false"), (STRINGS, str, "a string"),
                               (MAPS, dict, "an object")):
        for name in names:
            if c.get(name) is not None and not isinstance(c[name], kind):
                raise bad(path, f"{prefix}{name} is {c[name]!r}, not {label}")
    architectures = c.get("architectures")
    if architectures is not None and (not isinstance(architectures, list) or not all(
            isinstance(a, str) for a in architectures)):
        raise bad(path, f"{prefix}architectures is not a list of names")
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    kv = c.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise bad(path, f"{prefix}num_key_value_heads {kv} does not divide "
                        f"num_attention_heads {heads}")
    if isinstance(heads, int) and isinstance(hidden, int) and c.get("head_dim") is None \
            and hidden % heads:
        raise bad(path, f"{prefix}hidden_size {hidden} is not divisible by "
                        f"num_attention_heads {heads} (and no head_dim is given)")
    check_size(path, c, prefix)
    if isinstance(c.get("text_config"), dict):
        check_fields(path, c["text_config"], f"{prefix}text_config.")


def check_size(path: Path, c: dict[str, Any], prefix: str) -> None:
    """The weights the shape implies (embedding, attention and feed-forward per layer) in
    fp32 bytes fit in int64: each bound alone is sane, a crafted product of them is not."""
    def get(name: str, default: int = 1) -> int:
        value = c.get(name)
        return value if isinstance(value, int) else default

    hidden, layers = get("hidden_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    head_dim = get("head_dim", hidden // heads or 1)
    experts = max(get("num_experts"), get("num_local_experts"))
    ffn = max(get("intermediate_size"), experts * get("moe_intermediate_size"))
    per_layer = 4 * hidden * heads * head_dim + 3 * hidden * ffn
    total = 2 * get("vocab_size") * hidden + layers * per_layer
    rope = get("max_position_embeddings") * head_dim
    for what, elements in (("the model", total), ("its RoPE table", rope)):
        if elements * 4 > INT64_MAX:
            raise bad(path, f"{prefix}hidden_size, intermediate_size, num_hidden_layers and "
                            f"vocab_size make {what} {elements:.3g} elements, past int64 bytes")


def read_config(path: Path) -> dict[str, Any]:
    """config.json as checked data (see the module docstring); a ConfigError otherwise."""
    try:
        config = read_json_capped(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise bad(path, "missing (not a Hugging Face model folder)") from None
    except (OSError, ValueError) as e:
        raise bad(path, f"unusable ({e})") from None
    if not isinstance(config, dict):
        raise bad(path, "not a JSON object")
    if json_depth(config, MAX_CONFIG_DEPTH) > MAX_CONFIG_DEPTH:
        raise bad(path, f"nests more than {MAX_CONFIG_DEPTH} deep")
    check_fields(path, config)
    return config


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names a key twice is refused (readers disagree on which wins)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"names {key!r} twice")
        out[key] = value
    return out


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, its header checked against the file's size."""
    try:
        size = regular_size(path)
        with open_regular(path) as f:
            if size < 8:
                raise bad(path, f"has {size} bytes, fewer than the 8 of a header length")
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise bad(path, f"header length {length:,} runs past the file's {size:,} "
                                f"bytes (or the {MAX_HEADER_BYTES:,} allowed)")
            raw = f.read(length)
    except OSError as e:
        raise bad(path, f"unreadable ({e.strerror or e})") from None
    except ValueError as e:  # not a regular file
        raise bad(path, str(e)) from None
    try:
        header = json.loads(raw, object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError) as e:
        raise bad(path, f"header is not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise bad(path, "header is not a JSON object")
    data = size - 8 - length
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise bad(path, "__metadata__ is not a map of strings")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, record in header.items():
        tensors[name] = tensor_info(path, name, record, data)
        spans.append((*record["data_offsets"], name))
    check_tiling(path, spans, data)
    return tensors


def tensor_info(path: Path, name: str, record: Any, data: int) -> TensorInfo:
    """One header entry: known dtype, a shape of at most MAX_DIMS sizes, offsets inside the
    data whose length is the shape's bytes."""
    where = f"tensor {name}"
    if not isinstance(record, dict) or set(record) != {"dtype", "shape", "data_offsets"}:
        raise bad(path, f"{where}: not an entry of dtype, shape and data_offsets")
    dtype, shape, offsets = record["dtype"], record["shape"], record["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise bad(path, f"{where}: dtype {dtype!r} is not a known safetensors dtype")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= INT64_MAX
            for n in shape):
        raise bad(path, f"{where}: shape {str(shape)[:80]} is not a list of at most "
                        f"{MAX_DIMS} sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in offsets):
        raise bad(path, f"{where}: data_offsets {str(offsets)[:80]} is not two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        raise bad(path, f"{where}: data_offsets [{begin}, {end}] lie outside the file's "
                        f"{data:,} data bytes")
    info = TensorInfo(path, dtype, tuple(shape))
    if info.nbytes != end - begin:
        raise bad(path, f"{where}: shape {shape} of {dtype} is {info.nbytes:,} bytes, its "
                        f"data_offsets span {end - begin:,}")
    return info


def check_tiling(path: Path, spans: list[tuple[int, int, str]], data: int) -> None:
    """The tensors cover the data exactly once, in offset order (no overlap, no gap)."""
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            kind = "overlap the previous tensor" if begin < position else "leave a gap"
            raise bad(path, f"tensor {name}: data_offsets [{begin}, {end}] {kind}")
        position = end
    if position != data:
        raise bad(path, f"the tensors cover {position:,} of its {data:,} data bytes")


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the shard file holding it, from the index or the single file (names
    checked, files not yet opened)."""
    index = folder / INDEX
    if index.exists() or index.is_symlink():
        try:
            weight_map = read_json_capped(index, MAX_INDEX_BYTES)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise bad(index, f"unusable ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise bad(index, "weight_map is not a map of tensor names to file names")
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file or file in (".", "..") or not file.endswith(
                    ".safetensors"):
                raise bad(index, f"weight_map names {file!r}, not a .safetensors file in the "
                                 "folder")
            if not (folder / file).exists():
                raise bad(index, f"weight_map names shard {file}, which is missing")
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE).exists() or (folder / SINGLE).is_symlink():
        return {}
    pickled = [name for name in PICKLED if (folder / name).exists()]
    if pickled:
        raise bad(folder, f"holds only {pickled[0]}, no safetensors weights; loom never "
                          "unpickles weights (it can run code): convert them to safetensors")
    raise bad(folder, f"holds no weights ({SINGLE} or {INDEX})")


def read_weights(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the folder's safetensors, each header checked; the index's names
    each in the shard it names."""
    files = weight_files(folder)
    if not files:
        return read_header(folder / SINGLE)
    tensors: dict[str, TensorInfo] = {}
    headers = {file: read_header(file) for file in sorted(set(files.values()))}
    for name, file in files.items():
        if name not in headers[file]:
            raise bad(folder / INDEX, f"weight_map puts {name} in {file.name}, which does "
                                      "not hold it")
        tensors[name] = headers[file][name]
    return tensors


def check_weights_hold(folder: HFFolder) -> None:
    """config.json describes no more weights than the safetensors hold, judged by a bound
    every decoder meets (an embedding of vocab_size x hidden_size, a norm of hidden_size
    per layer; quantized folders keep both unpacked): an inflated size fails here, before
    anything builds the model it describes."""
    c = folder.config
    sizes = [c.get(n) for n in ("vocab_size", "hidden_size", "num_hidden_layers")]
    if not all(isinstance(n, int) for n in sizes):
        return
    vocab, hidden, layers = sizes
    least = vocab * hidden + layers * hidden
    if least > folder.stored_elements:
        raise bad(folder.path / CONFIG, f"vocab_size {vocab}, hidden_size {hidden} and "
                                        f"num_hidden_layers {layers} need at least {least:,} "
                                        f"weights; the safetensors hold "
                                        f"{folder.stored_elements:,}")


def open_folder(folder: Path) -> HFFolder:
    """A local Hugging Face folder, config and weights checked; nothing in it runs."""
    checked = HFFolder(folder, read_config(folder / CONFIG), read_weights(folder))
    check_weights_hold(checked)
    return checked
