# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

from unittest import mock

import torch

from megatron.training.datasets import data_samplers


class _Args:
    """The training arguments build_pretraining_data_loader reads; the rest are unset."""

    def __init__(self, seed):
        self.seed = seed
        self.dataloader_type = 'single'
        self.micro_batch_size = 2
        self.global_batch_size = 2
        self.num_workers = 0

    def __getattr__(self, name):
        return None


def _build(seed):
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    with (
        mock.patch.object(data_samplers, 'get_args', return_value=_Args(seed)),
        mock.patch.object(data_samplers, 'mpu') as mpu,
    ):
        mpu.get_data_parallel_rank.return_value = 0
        mpu.get_data_parallel_world_size.return_value = 1
        return data_samplers.build_pretraining_data_loader(dataset, consumed_samples=0)


class TestPretrainingDataLoaderGenerator:
    """pretrain() restores the RNG state from a checkpoint before it builds the data iterators.
    Creating a DataLoader iterator draws the workers' base seed; drawn from the global CPU
    generator, it put a resumed run one draw ahead of the run that never stopped."""

    def test_iterator_leaves_the_global_generator_alone(self):
        torch.manual_seed(1234)
        before = torch.get_rng_state()
        batch = next(iter(_build(seed=1234)))
        assert torch.equal(batch[0], torch.tensor([0, 1]))
        assert torch.equal(torch.get_rng_state(), before)

    def test_generator_is_seeded_with_the_run_seed(self):
        assert _build(seed=1234).generator.initial_seed() == 1234
        assert _build(seed=77).generator.initial_seed() == 77
