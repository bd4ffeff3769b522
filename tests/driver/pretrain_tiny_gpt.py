"""The project's own GPT entry point for ``megatron.training.pretrain()``.

A user's machine has the ``megatron-core`` wheel, which ships ``megatron.training`` but not
Megatron-LM's ``pretrain_gpt.py``. This script is what such a user writes to train a GPT with
``pretrain()``: a model provider, a forward step with its loss function and a mock-data dataset
provider, all from the public API of ``megatron.core`` and ``megatron.training``. It takes
Megatron-LM's command line (``--num-layers``, ``--mock-data``, ``--warmup-train-steps`` on the
fork, ...) and runs unmodified on every maintained base (0.18.2, 0.19.2, dev).

The tests run it as ``__main__`` in harness worlds (tests/scenarios/pretrain.py); with a
Megatron-LM clone (``FORK_MEGATRON_LM``) the same tests also run upstream's own
``pretrain_gpt.py``. Run it alone like any Megatron entry point::

    torchrun --nproc-per-node 2 tests/driver/pretrain_tiny_gpt.py --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 127 --num-layers 2 --hidden-size 64 ...

What it supports: the local transformer spec (``--transformer-impl local``) and Transformer
Engine's, dense and MoE layers, multi-token prediction, tensor, pipeline and context
parallelism; the loss is the token-summed cross entropy with the NaN, Inf and spiky-loss checks
of the rerun state machine. Not supported: real data files, SFT, FIM, ModelOpt, yaml configs.
"""

from functools import partial

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

# A loss this many times the largest seen so far counts as spiky (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10
BATCH_KEYS = ('tokens', 'labels', 'loss_mask', 'position_ids')


def _layer_spec(args, config, vp_stage):
    use_te = args.transformer_impl == 'transformer_engine'
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm
        )
    return get_gpt_layer_local_spec(
        config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, **kwargs):
    """A GPTModel as the command line describes it (``pg_collection`` passed on when given)."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    layer_spec = _layer_spec(args, config, vp_stage)
    mtp_block_spec = None
    if args.mtp_num_layers:
        # The MTP layers are built like the last decoder layer.
        layers = getattr(layer_spec, 'layer_specs', None)
        mtp_layer_spec = layers[-1] if layers else layer_spec
        if layers is not None and not layers:
            mtp_layer_spec = get_gpt_layer_local_spec(
                config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm
            )
        mtp_block_spec = get_gpt_mtp_block_spec(
            config,
            mtp_layer_spec,
            use_transformer_engine=args.transformer_impl == 'transformer_engine',
            vp_stage=vp_stage,
        )
    extra = {}
    if kwargs.get('pg_collection') is not None:
        extra['pg_collection'] = kwargs['pg_collection']
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        **extra,
    )


def _needs_batch(vp_stage):
    """Only the first and the last pipeline stage read batches (tokens in, labels out)."""
    kwargs = {} if vp_stage is None else {'ignore_virtual': False, 'vp_stage': vp_stage}
    return mpu.is_pipeline_first_stage(**kwargs) or mpu.is_pipeline_last_stage(**kwargs)


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch of this rank: read on tensor-parallel rank 0, broadcast to its peers."""
    args = get_args()
    if not _needs_batch(vp_stage):
        return {key: None for key in BATCH_KEYS + ('attention_mask',)}
    keys = BATCH_KEYS + (('attention_mask',) if args.create_attention_mask_in_dataloader else ())
    device = (
        torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    if mpu.get_tensor_model_parallel_rank() == 0:
        raw = next(data_iterator)
        batch = {key: raw[key].to(device) if device else raw[key] for key in keys}
    else:
        shape = (args.micro_batch_size, args.seq_length)
        batch = {
            'tokens': torch.empty(shape, dtype=torch.int64, device=device),
            'labels': torch.empty(shape, dtype=torch.int64, device=device),
            'loss_mask': torch.empty(shape, dtype=torch.float32, device=device),
            'position_ids': torch.empty(shape, dtype=torch.int64, device=device),
        }
        if 'attention_mask' in keys:
            mask_shape = (args.micro_batch_size, 1, args.seq_length, args.seq_length)
            batch['attention_mask'] = torch.empty(mask_shape, dtype=torch.bool, device=device)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        for key in keys:
            torch.distributed.broadcast(
                batch[key],
                mpu.get_tensor_model_parallel_src_rank(),
                group=mpu.get_tensor_model_parallel_group(),
            )
    batch.setdefault('attention_mask', None)
    return _this_cp_rank_part(batch)


def _this_cp_rank_part(batch):
    """Context parallelism: the sequence in 2 x CP chunks, rank r keeps chunks r and 2CP-1-r
    (each rank gets an early and a late part, so causal attention work is balanced)."""
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        return batch
    rank = mpu.get_context_parallel_rank()
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        dim = 2 if key == 'attention_mask' else 1
        chunks = value.chunk(2 * cp, dim=dim)
        out[key] = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)
    return out


def loss_func(loss_mask, output_tensor):
    """Token-summed loss, its token count, and what training_log reports as 'lm loss'."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, 'NaN'), (torch.isinf, 'Inf')):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f'found {what} in local forward loss calculation',
                tolerance=0.0,
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context='loss'
            ),
            message='Spiky loss',
            tolerance=0.0,
            fatal=False,
        )
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {'lm loss': report}


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the output and the loss function to apply to it."""
    vp_stage = get_attr_wrapped_model(model, 'vp_stage', allow_none=True)
    batch = get_batch(data_iterator, vp_stage)
    output = model(
        batch['tokens'],
        batch['position_ids'],
        batch['attention_mask'],
        labels=batch['labels'],
        loss_mask=batch['loss_mask'],
    )
    return output, partial(loss_func, batch['loss_mask'])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock GPT datasets (``--mock-data``), built on tensor-parallel rank 0 of the data stages."""
    args = get_args()
    if not args.mock_data:
        raise SystemExit('pretrain_tiny_gpt.py: only --mock-data is supported; add --mock-data')
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and _needs_batch(vp_stage)

    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, built_here, config
    ).build()


# Every rank calls the provider; it decides itself where datasets are built.
train_valid_test_datasets_provider.is_distributed = True


def main():
    """Parse Megatron's command line and train."""
    args = parse_and_validate_args(args_defaults={'tokenizer_type': 'NullTokenizer'})
    pretrain(
        pretrain_cfg_container_from_args(args),
        train_valid_test_dataset_provider=train_valid_test_datasets_provider,
        model_provider=model_provider,
        model_type=ModelType.encoder_or_decoder,
        forward_step_func=forward_step,
    )


if __name__ == '__main__':
    main()
