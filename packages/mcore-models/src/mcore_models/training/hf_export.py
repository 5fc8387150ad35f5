"""``--export-hf``: the final model as a Hugging Face checkpoint of the family that holds it.

A dense model is written as Llama; an MoE model as the first of Mixtral, Qwen3-MoE and Qwen2-MoE
whose layout it has (Mixtral: no biases; Qwen3-MoE: qk-norm; Qwen2-MoE: q/k/v biases and a gated
shared expert); a hybrid model as NemotronH (``export_nemotron_h``; what NemotronH cannot
represent is refused before training, see ``check_hybrid_export``). With expert (tensor)
parallelism the ranks holding one copy of every expert take part (the expert-parallel and
expert-tensor-parallel peers of data-parallel rank 0) and one of them writes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import ConfigError, ProcessGroupCollection, get_group_device

from ..config.transformer_config import TransformerConfig
from ..hf.checkpoint import export_hf_checkpoint
from ..hf.registry import mapping_for
from ..models.hybrid.model import HybridModel
from ..models.hybrid.nemotron_h_export import export_nemotron_h, nemotron_h_hf_config

_DENSE_FAMILIES = ("llama",)
_MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")


def hf_model_type(config: TransformerConfig) -> str:
    """The Hugging Face ``model_type`` ``--export-hf`` writes ``config``'s model as.

    Raises:
        ConfigError: no supported family holds the model; the message gives each family's reason.
    """
    if getattr(config, "hybrid_layer_pattern", None) is not None:
        return "nemotron_h"
    families = _DENSE_FAMILIES if config.num_moe_experts is None else _MOE_FAMILIES
    reasons = []
    for family in families:
        try:
            mapping_for(family).config_to_hf(config, vocab_size=1)
        except ValueError as error:
            reasons.append(f"{family}: {error}")
        else:
            return family
    raise ConfigError(["export_hf"], "no Hugging Face family holds this model (" + "; ".join(reasons) + ")")


def check_hybrid_export(model) -> None:
    """Refuse, before training, to ``--export-hf`` a hybrid model (this rank's first chunk
    ``model``) that NemotronH cannot represent (``NotImplementedError``, see
    ``nemotron_h_hf_config``); other models are checked by ``hf_model_type``."""
    if isinstance(model, HybridModel):
        nemotron_h_hf_config(model)


def export_final_model(model, groups: ProcessGroupCollection, directory: str, tokenizer) -> None:
    """``model`` (this rank's unsharded ``GPTModel``, PP = 1) as a Hugging Face checkpoint whose eos
    and pad ids are the tokenizer's end-of-document and pad ids (collective over all ranks)."""
    model.eos_token_ids, model.pad_token_id = (tokenizer.eod_id,), tokenizer.pad_id
    writer_replica = all(dist.get_rank(g) == 0 for g in (groups.dp, groups.cp) if g is not None)
    takes_part = torch.tensor([float(writer_replica)], device=get_group_device(groups.tp))
    # the expert-parallel peers holding the writing replica's other experts, and the expert-TP
    # peers holding the other slices of them, join it
    for group in (groups.ep, groups.expert_tp):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(takes_part, op=dist.ReduceOp.MAX, group=group)
    if takes_part.item() and isinstance(model, HybridModel):
        export_nemotron_h(model, directory)
    elif takes_part.item():
        export_hf_checkpoint(model, directory, model_type=hf_model_type(model.config))
    dist.barrier()
