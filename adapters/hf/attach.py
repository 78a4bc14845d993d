"""Attach and detach the memory, and the memory configuration that travels with the model:
stored in ``model.config.tensor_memory`` (so ``save_pretrained`` writes it), checked and
rebuilt by :func:`from_pretrained` and by the ``Auto`` classes (``model_type =
"tensor_memory"``, registered on import by :func:`register_auto_classes`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from tmcore import layer as tl
from tmcore.adapters.hf.blocks import (
    CONFIG_KEY,
    check_fits,
    config_int,
    find_blocks,
    resolve,
    transformers_module,
    unmark_config,
)
from tmcore.adapters.hf.cache import HFMemory
from tmcore.adapters.torch import attach as _torch_attach
from tmcore.adapters.torch import attach_memory as _attach_blocks
from tmcore.runtime.validate import check_finite, check_flag, check_int

__all__ = ["MODEL_TYPE", "attach_memory", "check_spec", "detach_memory", "from_pretrained",
           "memory_of", "register_auto_classes"]

#: Version of the stored configuration's layout.
FORMAT = 2
#: The stored configuration's own keys; the others are the layer's
#: (:meth:`tmcore.layer.LayerConfig.to_dict`).
_SPEC_KEYS = ("format", "blocks", "num_blocks", "gate_init", "norm", "streaming")
_NORMS = ("layernorm", "identity")
#: What the names of the memory's weights (and only theirs) hold in a model's state dict.
_MARKER = f".{_torch_attach.ATTRIBUTE}."


def memory_of(model: nn.Module) -> HFMemory | None:
    """The :class:`HFMemory` attached to ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A model :func:`attach_memory` or :func:`from_pretrained` may have
        given a memory.

    Returns
    -------
    HFMemory or None
        Its memory, or ``None`` if it has none.
    """
    return getattr(model, "_tmcore_hf_memory", None)


def attach_memory(
    model: nn.Module, *, memory_channels: int, memory_shape: Sequence[int], chunk_size: int,
    zero_init: bool = True, gate_init: float = 0.0, norm: str = "layernorm",
    blocks: str | None = None, streaming: bool = False, embed_dim: int | None = None,
    **options: Any,
) -> HFMemory:
    """Add a gated Tensor Memory after every decoder block of ``model`` (one call).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
        ``Qwen2ForCausalLM``, ...); its blocks are found by :func:`find_blocks`.
    memory_channels, memory_shape, chunk_size : int, sequence of int, int
        The layer's sizes ``C``, ``S``, ``L`` (:func:`tmcore.layer.layer_config`).
    zero_init : bool, default True
        The read-outs start at zero: the model's outputs are bit-identical to
        the original's until the memory trains, and the read-outs still get a
        gradient.
    gate_init : float, default 0.0
        The residual gate's initial logit.
    norm : {"layernorm", "identity"}, default "layernorm"
        What the memory reads: a LayerNorm of the block's output, or the output.
    blocks : str or None, default None
        A dotted path to the blocks' ``nn.ModuleList``; overrides the search.
    streaming : bool, default False
        Streaming training: uncached forwards in training mode continue,
        detached, from the previous one (truncated backprop); ``False``: every
        uncached forward starts fresh. Cached calls always follow the cache.
    embed_dim : int or None, default None
        The token width ``d``; default the config's ``hidden_size``.
    **options
        The layer's other keywords (:func:`tmcore.layer.layer_config`:
        ``sigma_scale``, ``checkpoint_every``, ``radius``, ``eps``,
        ``forget_bias``, ``update``, ``window``, ``dynamics``, ``flow``).

    Returns
    -------
    HFMemory
        The attached memories; :func:`detach_memory` (or ``.remove()``) undoes
        the attach exactly. The configuration is stored in
        ``model.config.tensor_memory``.

    Raises
    ------
    TypeError
        If ``model`` is not a ``PreTrainedModel``, ``streaming`` is not a bool
        or a layer argument has the wrong kind (the layer's checks).
    ValueError
        If ``model`` already has a memory, its blocks are not found or their owner is
        not called with the tokens (an encoder's inner stack), ``embed_dim`` is not
        the hidden size, ``norm`` is unknown or a layer argument is out of range.
    """
    if memory_of(model) is not None:
        raise ValueError("model: already has a Tensor Memory attached; detach_memory first")
    path, _, found = find_blocks(model, blocks)
    embed_dim = config_int(model.config, "hidden_size") if embed_dim is None else embed_dim
    if embed_dim is None:
        raise ValueError("model: its config has no integer hidden_size; pass embed_dim=")
    config = tl.layer_config(embed_dim, memory_channels, memory_shape, chunk_size,
                             zero_init=zero_init, **options)
    spec = {"format": FORMAT, "blocks": path, "num_blocks": len(found),
            "gate_init": check_finite("gate_init", gate_init), "norm": _norm(norm, "norm"),
            "streaming": check_flag("streaming", streaming), **config.to_dict()}
    return _attach_spec(model, spec, config, "embed_dim")


def _norm(norm: Any, name: str) -> str:
    if norm not in _NORMS:
        raise ValueError(f"{name}: expected one of {_NORMS}, got {norm!r}")
    return norm


def _attach_spec(model: nn.Module, spec: dict[str, Any], config: tl.LayerConfig,
                 where: str = f"{CONFIG_KEY}.embed_dim") -> HFMemory:
    """Attach the memory a checked ``spec`` (and its layer ``config``) describes."""
    path, owner, found = find_blocks(model, spec["blocks"])
    if len(found) != spec["num_blocks"]:
        raise ValueError(f"{CONFIG_KEY}.num_blocks: stored {spec['num_blocks']} blocks at "
                         f"{path!r}, the model has {len(found)}")
    check_fits(model, path, owner, config.embed_dim, where)
    handle = _attach_blocks(found, "causal", gate_init=spec["gate_init"],
                            norm=None if spec["norm"] == "layernorm" else nn.Identity(),
                            streaming=True, batch_first=True, **config.to_dict())
    memory = HFMemory(model, path, owner, handle, spec)
    model._tmcore_hf_memory = memory
    setattr(model.config, CONFIG_KEY, dict(spec))
    _mark_config(model)
    return memory


def detach_memory(model: nn.Module) -> None:
    """Remove the memory :func:`attach_memory` added (the model is exactly as before).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model with a memory attached.

    Raises
    ------
    ValueError
        If ``model`` has no memory attached.
    """
    memory = memory_of(model)
    if memory is None:
        raise ValueError("model: has no Tensor Memory attached")
    memory.remove()


# --------------------------------------------------------------------------- save / load


def check_spec(spec: Any, config: Any = None) -> tl.LayerConfig:
    """Check a stored memory configuration (``config.tensor_memory``); give its layer.

    Parameters
    ----------
    spec : dict
        The stored configuration: ``format``, ``blocks``, ``num_blocks``,
        ``gate_init``, ``norm``, ``streaming`` and the layer's fields
        (:meth:`tmcore.layer.LayerConfig.to_dict`), every one present.
    config : transformers.PretrainedConfig, optional
        The model's config: its ``num_hidden_layers`` must be ``num_blocks``
        (checked before the model is built).

    Returns
    -------
    tmcore.layer.LayerConfig
        The layer's configuration.

    Raises
    ------
    TypeError, ValueError
        Naming ``tensor_memory.<key>`` (or ``num_hidden_layers``): a key missing or
        unknown, a value of the wrong kind or out of range.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"{CONFIG_KEY}: expected a dict in the model config, "
                        f"got {type(spec).__name__}")
    missing = [k for k in _SPEC_KEYS if k not in spec]
    if missing:
        raise ValueError(f"{CONFIG_KEY}: missing keys {missing} (saved by another tmcore "
                         f"version?)")
    if type(spec["format"]) is not int or spec["format"] != FORMAT:
        raise ValueError(f"{CONFIG_KEY}.format: expected the int {FORMAT}, "
                         f"got {spec['format']!r}")
    check_flag(f"{CONFIG_KEY}.streaming", spec["streaming"])
    check_finite(f"{CONFIG_KEY}.gate_init", spec["gate_init"])
    _norm(spec["norm"], f"{CONFIG_KEY}.norm")
    if not isinstance(spec["blocks"], str):
        raise TypeError(f"{CONFIG_KEY}.blocks: expected a dotted path, got {spec['blocks']!r}")
    blocks = check_int(f"{CONFIG_KEY}.num_blocks", spec["num_blocks"], 1)
    layers = None if config is None else config_int(config, "num_hidden_layers")
    if layers is not None and layers != blocks:
        raise ValueError(f"num_hidden_layers: the config asks for {layers} decoder layers, "
                         f"its {CONFIG_KEY} records {blocks} blocks (num_blocks); nothing "
                         f"was built")
    layer = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
    return tl.LayerConfig.from_dict(layer, CONFIG_KEY)


def _check_saved_shapes(path: str, config: tl.LayerConfig) -> None:
    """Compare the memory weights' shapes in a folder's safetensors files with the stored
    configuration BEFORE any block is built: a few edited bytes of ``config.json``
    (``chunk_size`` 10**6) would otherwise allocate gigabytes first. Reads headers only;
    a folder without safetensors files is left to the strict load."""
    from safetensors import safe_open

    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    expected = {spec.name: tuple(spec.shape) for spec in tl.param_specs(config)}
    marker = f"{_MARKER}memory."
    for name in files:
        with safe_open(os.path.join(path, name), "np") as handle:
            for key in handle.keys():
                leaf = key.split(marker, 1)[1] if marker in key else None
                if leaf in expected:
                    stored = tuple(handle.get_slice(key).get_shape())
                    if stored != expected[leaf]:
                        raise ValueError(
                            f"{CONFIG_KEY}: the stored configuration does not fit the saved "
                            f"memory weights: {key} has shape {stored}, the configuration "
                            f"gives {expected[leaf]} (nothing was built)")


def from_pretrained(path: str | os.PathLike, model_class: Any = None, **kwargs: Any
                    ) -> nn.Module:
    """Load a model saved with its memory (``save_pretrained``) and its memory, in one call.

    The memory configuration is read from ``config.json`` (``tensor_memory``) and
    checked (:func:`check_spec`); the memory weights are loaded strictly (every
    memory tensor present, none unknown, shapes and the grid checked), so the
    result equals the saved model bit for bit.

    Parameters
    ----------
    path : str or os.PathLike
        A local folder written by ``save_pretrained`` of a model with memory.
    model_class : type, optional
        The class to load with (default ``AutoModelForCausalLM``; an ``Auto*``
        class or a concrete one). Another head than the saved one reads the checkpoint
        as transformers does (``AutoModel``: the backbone, with its memory).
    **kwargs
        Passed to its ``from_pretrained`` (``torch_dtype``, ...).

    Returns
    -------
    transformers.PreTrainedModel
        The model with its memory attached (:func:`memory_of` gives it).

    Raises
    ------
    ValueError
        If ``path`` is not a folder, its config has no memory configuration
        or an invalid one, or the memory weights do not fit it.
    TypeError
        If a stored configuration value is of the wrong kind (:func:`check_spec`).
    """
    transformers = transformers_module()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path: expected a local folder written by save_pretrained, "
                         f"got {path!r}")
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    if getattr(config, CONFIG_KEY, None) is None:
        raise ValueError(f"path: {path!r} has no '{CONFIG_KEY}' in its config.json (saved "
                         f"without memory?); load it with the model class's from_pretrained")
    base = getattr(type(config), "_tmcore_base", type(config))
    concrete = model_class or transformers.AutoModelForCausalLM
    if getattr(concrete, "_model_mapping", None) is not None:  # an Auto class: its head
        concrete = concrete._model_mapping[base]
    if getattr(concrete, "_tmcore_memory_class", False):
        concrete = concrete.__mro__[1]
    # loaded as the Auto classes load it (the memory attached by __init__, its weights
    # checked and loaded with the rest), then given the model's own class back
    model = _memory_model_class(_memory_config_class(base), concrete).from_pretrained(
        path, config=config, **kwargs)
    model.__class__ = concrete
    return model


def _few(keys: list[str]) -> str:
    """An error's list of ``keys``: the first four, ``...`` after them if there are more."""
    return f"{keys[:4]}{'...' if len(keys) > 4 else ''}"


# --------------------------------------------------------------------------- Auto classes

#: The ``model_type`` a model with memory saves in ``config.json`` (registered with
#: ``AutoConfig``); ``base_model_type`` next to it names the model it extends.
MODEL_TYPE = "tensor_memory"
_BASE_KEY = "base_model_type"


def _memory_to_dict(config: Any) -> dict[str, Any]:
    """A config with memory's ``to_dict``: its base class's, with ``base_model_type``."""
    return {**config._tmcore_base.to_dict(config), _BASE_KEY: config._tmcore_base.model_type}


def _memory_config_class(base: type) -> type:
    """The config class of ``base`` with memory: the same fields and behaviour, saved with
    ``model_type = "tensor_memory"`` and ``base_model_type`` (one class per base, made
    once, a module attribute so that pickling finds it)."""
    if getattr(base, "_tmcore_base", None) is not None:
        return base
    name = f"TensorMemory{base.__name__}"
    if name not in globals():
        globals()[name] = type(name, (base,), {
            "model_type": MODEL_TYPE, "_tmcore_base": base, "to_dict": _memory_to_dict,
            "__module__": __name__,
            "__doc__": f"{base.__name__} with Tensor Memory (``config.{CONFIG_KEY}``)."})
    return globals()[name]


def _memory_model_class(config_class: type, model_class: type, auto: Any = None) -> type:
    """``model_class`` whose ``__init__`` attaches the memory its config stores, registered
    with the Auto class ``auto`` (``AutoModelForCausalLM``, ...; none: not registered) for
    ``config_class``."""
    if getattr(model_class, "_tmcore_memory_class", False):
        return model_class
    name = f"TensorMemory{model_class.__name__}"
    if getattr(globals().get(name), "config_class", None) is not config_class:
        globals()[name] = _make_memory_model_class(name, config_class, model_class)
        _share_conversions(model_class, name)
    if auto is not None:  # registered each time: the Auto class builds the class last asked
        # for (a checkpoint's own architecture, read just before its model is built)
        auto.register(config_class, globals()[name], exist_ok=True)
    return globals()[name]


def _make_memory_model_class(name: str, config_class: type, model_class: type) -> type:
    """The class :func:`_memory_model_class` registers (``__init__``, ``from_pretrained``)."""
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        spec = getattr(config, CONFIG_KEY, None)
        if spec is None:
            raise ValueError(f"config: {type(self).__name__} needs the memory configuration "
                             f"'{CONFIG_KEY}' in its config (saved by a model with memory)")
        layer = check_spec(spec, config)  # before the blocks are built
        # as the base model (heads that build their body with AutoModel.from_config know
        # no memory config class)
        memory_config = unmark_config(config)
        try:
            model_class.__init__(self, config, *args, **kwargs)
        finally:
            config.__class__ = memory_config
        _attach_spec(self, _blocks_of_this_head(self, spec), layer)

    @classmethod
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        info = kwargs.pop("output_loading_info", False)
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):  # before building
            stored = kwargs.get("config") or transformers_module().AutoConfig.from_pretrained(
                path)
            spec = getattr(stored, CONFIG_KEY, None)
            if isinstance(spec, Mapping):
                _check_saved_shapes(os.fspath(path), check_spec(spec, stored))
        model, loading = model_class.from_pretrained.__func__(cls, *args,
                                                              output_loading_info=True,
                                                              **kwargs)
        missing, unknown = ([k for k in loading.get(key, ()) if _MARKER in k]
                            for key in ("missing_keys", "unexpected_keys"))
        if missing or unknown:
            raise ValueError(f"pretrained_model_name_or_path: the memory weights do not fit "
                             f"its {CONFIG_KEY} config: missing {_few(sorted(missing))}, "
                             f"unknown {_few(sorted(unknown))}; the memory cannot be restored")
        return (model, loading) if info else model

    return type(name, (model_class,), {"__init__": __init__, "from_pretrained": from_pretrained,
                                       "config_class": config_class,
                                       "_tmcore_memory_class": True, "__module__": __name__,
                                       "__doc__": f"{model_class.__name__} with Tensor Memory "
                                                  f"attached from its config."})


def _blocks_of_this_head(model: nn.Module, spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with its blocks' path moved to ``model``'s layout: a head's checkpoint read
    by the base model (``AutoModel``: ``model.layers`` -> ``layers``) or the reverse, by
    the base model prefix transformers strips or adds when it loads."""
    blocks, prefix = spec["blocks"], getattr(model, "base_model_prefix", "") or ""
    stripped = blocks[len(prefix) + 1:] if blocks.startswith(prefix + ".") else None
    for moved in (blocks, stripped, f"{prefix}.{blocks}") if prefix else ():
        if moved is not None and resolve(model, moved) is not None:
            return {**spec, "blocks": moved}
    return spec


def _share_conversions(model_class: type, name: str) -> None:
    """Give the memory class ``name`` the checkpoint key conversions transformers keeps
    under ``model_class``'s name (GPT-NeoX: ``embed_out`` <-> ``lm_head``): the base class
    saves with them, so the memory class must load with them (else a weight is left
    freshly initialized). Nothing where this transformers has no such registry."""
    try:
        from transformers import conversion_mapping as conversions
        get, register = (conversions.get_checkpoint_conversion_mapping,
                         conversions.register_checkpoint_conversion_mapping)
    except (ImportError, AttributeError):
        return
    mapping = get(model_class.__name__)
    if mapping is not None:
        register(name, mapping, overwrite=True)


#: The Auto classes a model with memory is registered with, each for its own head
#: (``AutoModel``: the base model; a head builds its body with the base config class, so
#: the body gets no second memory).
_AUTO_HEADS = ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModel",
               "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")


def _register_heads(config_class: type, preferred: Sequence[type] = ()) -> bool:
    """Register, with each Auto class of :data:`_AUTO_HEADS` that has a head for the base
    config of ``config_class``, that head with memory: the first of ``preferred`` that is
    one (a subclass of it: a checkpoint's own architecture), else the head itself. Returns
    whether a class of ``preferred`` was registered."""
    transformers = transformers_module()
    base = getattr(config_class, "_tmcore_base", config_class)
    found = False
    for name in _AUTO_HEADS:
        auto = getattr(transformers, name, None)
        try:
            head = auto._model_mapping[base]
        except (AttributeError, KeyError, ValueError):
            continue
        chosen = next((c for c in preferred if issubclass(c, head)), head)
        found = found or chosen in preferred
        _memory_model_class(config_class, chosen, auto)
    return found


def _mark_config(model: nn.Module) -> None:
    """Make ``model.config`` save as ``tensor_memory`` (its class, not its values, swapped)
    and register the pair with the Auto classes, so that ``AutoModelForCausalLM`` (or the
    Auto class of the model's head) loads the model back with its memory."""
    base = type(model.config)
    if getattr(base, "model_type", ""):  # (a config with memory already: unchanged)
        model.config.__class__ = _memory_config_class(base)
    config_class = type(model.config)
    if not _register_heads(config_class, (type(model),)):
        # a model no Auto head knows (a custom class): AutoModelForCausalLM loads it, unless
        # its family has a causal LM there (it would replace it)
        transformers = transformers_module()
        try:
            transformers.AutoModelForCausalLM._model_mapping[
                getattr(config_class, "_tmcore_base", config_class)]
        except (KeyError, ValueError):
            _memory_model_class(config_class, type(model), transformers.AutoModelForCausalLM)


def _auto_config_class() -> type:
    transformers = transformers_module()

    class TensorMemoryConfig(transformers.PretrainedConfig):
        """The ``AutoConfig`` entry of ``model_type = "tensor_memory"``: builds the config
        of the base model named by ``base_model_type`` (with memory, registered with
        ``AutoModelForCausalLM``)."""

        model_type = MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
            config_dict = dict(config_dict)
            base_type = config_dict.pop(_BASE_KEY, None)
            config_dict.pop("model_type", None)
            mapping = transformers.CONFIG_MAPPING
            if not isinstance(base_type, str) or base_type == MODEL_TYPE \
                    or base_type not in mapping:
                raise ValueError(f"{_BASE_KEY}: a '{MODEL_TYPE}' config must name the model "
                                 f"it extends (one of transformers' model types, not "
                                 f"{MODEL_TYPE!r}), got {base_type!r}")
            config_class = _memory_config_class(mapping[base_type])
            named = (getattr(transformers, arch, None)
                     for arch in config_dict.get("architectures") or ())
            _register_heads(config_class, [c for c in named if isinstance(c, type)])
            # its memory configuration is checked by the model built from it
            return config_class.from_dict(config_dict, **kwargs)

    return TensorMemoryConfig


def register_auto_classes() -> None:
    """Register the ``tensor_memory`` model type with ``AutoConfig``.

    Done when ``tmcore.adapters.hf`` is imported with transformers installed. A model
    saved with memory writes ``model_type = "tensor_memory"`` and ``base_model_type``
    in its ``config.json``; after this registration ``AutoConfig`` /
    ``AutoModelForCausalLM.from_pretrained`` (and so ``pipeline``) load it with its
    memory. Without it, transformers refuses the unknown model type instead of
    silently dropping the memory.

    Raises
    ------
    ImportError
        If transformers is not installed.
    """
    transformers = transformers_module()
    if MODEL_TYPE not in transformers.CONFIG_MAPPING:
        transformers.AutoConfig.register(MODEL_TYPE, _auto_config_class(), exist_ok=True)
