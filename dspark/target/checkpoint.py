"""What the native runtime reads of a target: its config and its tensors by transformers' names.

The native runtime copies a model's weights into its own formats (or reads them packed from the
cache), so building transformers' model first is wasted work on every start: importing its
modeling code and auto classes alone takes seconds of a 2-core machine. A `Checkpoint` is the
config and the tensors, read from a model directory's safetensors where that is exact
(`from_dir`), or taken from a loaded transformers model (`from_model`, the API's
`NativeTarget(model)`); transformers' model is built only when a reference path asks for it
(`model()`), from the same files.

`from_dir` applies where reading the files gives what transformers' model would hold: one of the
native runtime's families, a config.json that states every field the runtime reads (a field left to
a config class's default, or a sliding-window setting that the class turns into per-layer types, is
transformers' to interpret), unscaled RoPE (a scaled type's frequencies come from transformers'
own rotary module, through `model()`), and weights in safetensors. Elsewhere the loader builds the
model (`dspark.target.load`), as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from dspark.errors import DSparkError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # the native runtime's (dspark.target.native)
# what the native runtime reads of a config, stated in config.json for from_dir to apply
STATED = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def _rope_params(cfg) -> dict:
    return dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})


def _type_of(params: dict) -> str:
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def rope_type(cfg) -> str:
    """A config's RoPE type (transformers 5's rope_parameters or the legacy rope_scaling)."""
    return _type_of(_rope_params(cfg))


def rope_inv_freq(base: float, dim: int) -> torch.Tensor:
    """Unscaled RoPE's inverse frequencies, computed as transformers' rotary modules compute them
    (the target's here, the draft's in dspark.model.layers)."""
    return 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def default_inv_freq(cfg) -> torch.Tensor:
    """rope_inv_freq of a config's rope_theta and head width."""
    base = _rope_params(cfg).get("rope_theta", getattr(cfg, "rope_theta", None))
    if base is None:
        raise DSparkError("the target's config names no rope_theta")
    return rope_inv_freq(base, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


class Checkpoint:
    """A causal LM's config and tensors (see the module docstring).

    tensor(name): the tensor transformers' model holds under `name` (fp32 from_dir, as the loader
    asks transformers for), `has(name)`, `embedding()`, `head()` (the tied embedding where the
    model ties it), `rope()` -> (inv_freq, attention scaling), `model()` -> transformers' model,
    built at the first call and kept."""

    def __init__(
        self,
        config,
        read: Callable[[str], torch.Tensor],
        shape: Callable[[str], tuple[int, ...]],
        names: set[str],
        build: Callable[[], object],
        *,
        device: torch.device,
        dtype: torch.dtype,
        tied: bool = False,
        generation_config=None,
        model=None,
    ):
        """read(name) / shape(name): a tensor held under `name` and its shape; tied: the head is the
        embedding (files whose config ties them)."""
        self.config, self._read, self._shape, self.names, self._build = config, read, shape, names, build
        self.device, self.dtype, self._tied = device, dtype, tied
        self.generation_config = generation_config
        self._model = model

    @classmethod
    def from_model(cls, model) -> Checkpoint:
        """A loaded transformers causal LM's config and tensors (shared, not copied)."""
        params = dict(model.state_dict(keep_vars=True))
        first = next(model.parameters())
        return cls(
            model.config,
            params.__getitem__,
            lambda name: tuple(params[name].shape),
            set(params),
            lambda: model,
            device=first.device,
            dtype=first.dtype,
            generation_config=getattr(model, "generation_config", None),
            model=model,
        )

    @classmethod
    def from_dir(cls, path: Path, build: Callable[[], object]) -> Checkpoint | None:
        """The checkpoint in `path` read from its safetensors (fp32, on the CPU); None where that
        would not be exactly what transformers' model holds (the module docstring). build(): the
        loader's transformers model of the same files, for model()."""
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if raw.get("model_type") not in FAMILIES or any(k not in raw for k in STATED):
            return None
        if raw.get("use_sliding_window") or raw.get("sliding_window") is not None:
            return None
        if any(t != "full_attention" for t in raw.get("layer_types") or []):
            return None
        if raw["model_type"] == "qwen3" and "head_dim" not in raw:
            return None  # Qwen3's config class defaults it to 128, not hidden / heads
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if _type_of(rope) != "default" or "rope_theta" not in {**raw, **rope}:
            return None
        files = _safetensors_files(path)
        if files is None:
            return None
        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                where.update(dict.fromkeys(st.keys(), f))
        cfg = PretrainedConfig(**{k: v for k, v in raw.items() if not k.startswith("_")})
        cfg._name_or_path = str(path)
        gen = None
        if (path / "generation_config.json").exists():
            try:
                gen = PretrainedConfig(**json.loads((path / "generation_config.json").read_text()))
            except ValueError:
                gen = None

        if not raw["tie_word_embeddings"] and HEAD not in where:
            return None  # transformers would initialise the head at random (and warn)
        opened: dict[Path, object] = {}

        def handle(name: str):
            f = where[name]
            if f not in opened:
                opened[f] = safe_open(str(f), framework="pt")
            return opened[f]

        def tensor(name: str) -> torch.Tensor:
            return handle(name).get_tensor(name).to(torch.float32)  # type: ignore[attr-defined]

        def shape(name: str) -> tuple[int, ...]:
            return tuple(handle(name).get_slice(name).get_shape())  # type: ignore[attr-defined]

        return cls(
            cfg,
            tensor,
            shape,
            set(where),
            build,
            device=torch.device("cpu"),
            dtype=torch.float32,
            tied=bool(raw["tie_word_embeddings"]),
            generation_config=gen,
        )

    def has(self, name: str) -> bool:
        return name in self.names

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise DSparkError(f"the target's checkpoint has no tensor {name!r}")
        return self._read(name).detach()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.names:
            raise DSparkError(f"the target's checkpoint has no tensor {name!r}")
        return self._shape(name)

    def embedding(self) -> torch.Tensor:
        if self._model is not None:
            return self._model.get_input_embeddings().weight.detach()
        return self.tensor(EMBED)

    def head(self) -> torch.Tensor:
        if self._model is not None:
            return self._model.get_output_embeddings().weight.detach()
        return self.embedding() if self._tied or not self.has(HEAD) else self.tensor(HEAD)

    def head_bias(self) -> torch.Tensor | None:
        if self._model is not None:
            b = self._model.get_output_embeddings().bias
            return None if b is None else b.detach()
        return self.tensor("lm_head.bias") if self.has("lm_head.bias") else None

    def rope(self) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling): the model's own rotary module's where the model is built
        or the RoPE is scaled; unscaled RoPE computed as that module computes it."""
        if self._model is None and rope_type(self.config) == "default":
            return default_inv_freq(self.config), 1.0
        rot = self.model().model.rotary_emb
        return rot.inv_freq.float(), float(getattr(rot, "attention_scaling", 1.0))

    def model(self):
        """transformers' model of this checkpoint, built at the first call (its modeling code
        imported then) and kept."""
        if self._model is None:
            self._model = self._build()
        return self._model


def checkpoint_of(model) -> Checkpoint:
    """A Checkpoint as given, or a loaded transformers model's."""
    return model if isinstance(model, Checkpoint) else Checkpoint.from_model(model)


def _safetensors_files(path: Path) -> list[Path] | None:
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError):
        return None
    files = [path / s for s in shards]
    return files if all(f.exists() for f in files) else None
