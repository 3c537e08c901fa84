"""How a Megatron ``GPTModel``'s weights split over pipeline stages, as pure functions on
state dicts (the trainer moves them between ranks with these; tests check them without a
process group).

Stage ``s`` of ``pp`` holds decoder layers ``[s * L/pp, (s + 1) * L/pp)`` under local
numbers from 0 (Megatron's ``TransformerBlock`` numbers each stage's layers from 0 and
offsets only ``layer_number``), the word embedding on the first stage and the final norm
and output layer on the last. With tied embeddings and more than one stage the last
stage holds its own copy of the embedding as ``output_layer.weight`` (Megatron keeps
the two equal by summing their gradients over the embedding group); the "full" state,
as at tp=1/pp=1, has only the embedding. ``to_stage`` and ``from_stage`` are exact
inverses on the full state (tested), so checkpoints and the weight cache are the same
bytes at any layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlix_async.train.tensor_parallel import LayoutError

EMBEDDING = "embedding.word_embeddings.weight"
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")
_LAYERS = "decoder.layers."


def check_layers(layers: int, pp: int) -> None:
    """Whole layers, as many on every stage, or LayoutError."""
    if layers % pp:
        raise LayoutError(
            f"pipeline parallel {pp} needs the model's layers ({layers}) to be a multiple of it"
        )


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The global numbers of the decoder layers stage ``stage`` holds."""
    per = layers // pp
    return range(stage * per, (stage + 1) * per)


def _layer(name: str) -> tuple[int, str] | None:
    """(layer number, the rest of the name) of a decoder layer's entry, else None."""
    if not name.startswith(_LAYERS):
        return None
    number, _, rest = name[len(_LAYERS) :].partition(".")
    return int(number), rest


def global_name(name: str, stage: int, pp: int, layers: int, tied: bool) -> str | None:
    """The full state's name of stage ``stage``'s entry ``name`` (None: the last stage's
    copy of a tied embedding, which the full state holds once, as the embedding)."""
    layer = _layer(name)
    if layer is not None:
        return f"{_LAYERS}{stage_layers(layers, pp, stage)[layer[0]]}.{layer[1]}"
    if tied and pp > 1 and name == "output_layer.weight":
        return None
    return name


def to_stage(
    full: Mapping[str, object], stage: int, pp: int, layers: int, tied: bool
) -> dict[str, object]:
    """Stage ``stage``'s entries of the full state dict, under its local names."""
    if pp == 1:
        return dict(full)
    mine = stage_layers(layers, pp, stage)
    last = stage == pp - 1
    out: dict[str, object] = {}
    for name, value in full.items():
        layer = _layer(name)
        if layer is not None:
            if layer[0] in mine:
                out[f"{_LAYERS}{layer[0] - mine.start}.{layer[1]}"] = value
        elif name == EMBEDDING:
            if stage == 0:
                out[name] = value
            if last and tied:
                out["output_layer.weight"] = value
        elif name.startswith(_LAST_STAGE):
            if last:
                out[name] = value
        elif name.startswith("embedding."):
            if stage == 0:
                out[name] = value
        else:
            raise KeyError(f"{name}: no pipeline stage holds it")
    return out


def from_stage(
    local: Mapping[str, object], stage: int, pp: int, layers: int, tied: bool
) -> dict[str, object]:
    """Stage ``stage``'s entries under the full state's names (the inverse of
    :func:`to_stage`; a tied embedding's last-stage copy left out)."""
    out: dict[str, object] = {}
    for name, value in local.items():
        full = global_name(name, stage, pp, layers, tied)
        if full is not None:
            out[full] = value
    return out


def full_param_order(stage_params: Sequence[str], layers: int, tied: bool) -> list[str]:
    """The trainable parameters of the whole (pp=1) model in its optimizer's order, from
    any stage's own (``stage_params``, in its order): every layer has the same
    parameters in the same order, after the embedding; then the final norm and an
    untied output layer."""
    template = [layer[1] for n in stage_params if (layer := _layer(n)) and layer[0] == 0]
    return (
        [EMBEDDING]
        + [f"{_LAYERS}{i}.{rest}" for i in range(layers) for rest in template]
        + ["decoder.final_layernorm.weight"]
        + ([] if tied else ["output_layer.weight"])
    )
