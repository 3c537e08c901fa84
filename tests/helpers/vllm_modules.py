"""vLLM's module trees for tiny configs made here (no hub), built the way a worker
builds its model (vLLM's ``initialize_model`` under the engine's config, a
one-rank model-parallel group over gloo) but with no engine around them and no
weights loaded, and what :func:`vllm_api.reload_needed` decides for each on CUDA.

Run as a script (``python -m tests.helpers.vllm_modules DIR``) it prints one JSON
object, kind -> the reload reason (null: direct copy): vLLM's distributed state is
global to a process, so tests build in a child process. The layer classes are
vLLM's own (MLAAttention, the fused-MoE method, fp8's online linear method); only
the attention backend under them is the CPU build's, which is why the decision is
asked for ``on_cuda=True`` (it reads the classes, not the device)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def configs() -> dict[str, tuple[transformers.PretrainedConfig, dict[str, Any]]]:
    """kind -> (a tiny HF config, engine arguments beyond the defaults)."""
    llama = transformers.LlamaConfig(**SMALL, head_dim=64, architectures=["LlamaForCausalLM"])
    return {
        "llama": (llama, {}),
        # DeepSeek-V3's MLA attention (kv_lora_rank) with dense MLPs only, so that MLA
        # is the one layer here that rules the direct copy out
        "deepseek_mla": (
            transformers.DeepseekV3Config(
                **SMALL,
                moe_intermediate_size=64,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=SMALL["num_hidden_layers"],
                kv_lora_rank=32,
                q_lora_rank=None,
                qk_nope_head_dim=32,
                qk_rope_head_dim=32,
                v_head_dim=32,
                n_group=1,
                topk_group=1,
                architectures=["DeepseekV3ForCausalLM"],
            ),
            {},
        ),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig(
                **SMALL,
                head_dim=64,
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                architectures=["Qwen3MoeForCausalLM"],
            ),
            {},
        ),
        # vLLM's online fp8 (weights quantised at load): fp8 wants bf16 activations
        "llama_fp8": (llama, {"quantization": "fp8", "dtype": "bfloat16"}),
    }


def build(model_dir: Path, **engine_args: Any) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        **{"dtype": "float32", **engine_args},
    )
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        if parallel_state._WORLD is None:  # once per process
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            parallel_state.initialize_model_parallel(1, 1)
        return initialize_model(vllm_config=config)


def main(root: Path) -> None:
    from rlix_async.shards.vllm import api as vllm_api

    decisions = {}
    # an MoE model first: the model-parallel groups are made once, under the first
    # config, and only an MoE config makes the expert-parallel group MoE layers ask for
    kinds = sorted(configs().items(), key=lambda item: "moe" not in item[0])
    for kind, (config, engine_args) in kinds:
        config.save_pretrained(root / kind)
        model = build(root / kind, **engine_args)
        decisions[kind] = vllm_api.reload_needed(model, on_cuda=True)
    print(json.dumps(decisions))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
