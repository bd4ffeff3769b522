# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.training import global_vars
from megatron.training.arguments import add_megatron_arguments
from megatron.training.checkpointing import _build_sharded_state_dict_metadata, get_rng_state
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils


class _Group:
    """A process group as get_rng_state() asks it: its rank and size."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


ONE = _Group(0, 1)


def _args():
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args([])
    args.ckpt_format = "torch_dist"
    global_vars.destroy_global_vars()
    global_vars.set_args(args)
    return args


class TestRngStatePerRank:
    """Each DP x CP rank's RNG states go into a checkpoint shard of their own."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()
        self.args = _args()

    def teardown_method(self, method):
        global_vars.destroy_global_vars()
        Utils.destroy_model_parallel()

    def test_each_dp_cp_rank_saves_its_own_shard(self):
        obj = get_rng_state("torch_dist", ONE, ONE, dp_cp_group=_Group(1, 2))
        assert isinstance(obj, ShardedObject)
        assert (obj.global_shape, obj.global_offset, obj.replica_id) == ((1, 1, 2), (0, 0, 1), 0)

    def test_the_metadata_records_the_dp_cp_size(self):
        metadata = _build_sharded_state_dict_metadata(self.args, dp_cp_group=_Group(0, 4))
        assert metadata.get("rng_state_dp_cp_size") == 4

    def test_a_checkpoint_of_the_older_layout_is_read_in_it(self):
        obj = get_rng_state("torch_dist", ONE, ONE, dp_cp_group=_Group(1, 2), saved_dp_cp_size=0)
        assert (obj.global_shape, obj.global_offset, obj.replica_id) == ((1, 1), (0, 0), 1)

    @pytest.mark.parametrize("saved", [1, 4])
    def test_a_checkpoint_of_another_dp_cp_size_is_not_read(self, saved):
        assert get_rng_state("torch_dist", ONE, ONE, _Group(1, 2), saved_dp_cp_size=saved) is None

    @pytest.mark.parametrize("layout", ["per-rank", "older"])
    def test_states_round_trip(self, tmp_path_dist_ckpt, layout):
        """Saved in either layout and loaded through the checkpoint's metadata, the states are
        the saved ones."""
        from megatron.training.rng_state_layout import saved_dp_cp_size

        torch.manual_seed(7)
        saved_layout = 0 if layout == "older" else None
        state = {"rng_state": get_rng_state("torch_dist", ONE, ONE, saved_dp_cp_size=saved_layout)}
        metadata = _build_sharded_state_dict_metadata(self.args)
        metadata.pop("dp_cp_group")
        if layout == "older":
            metadata.pop("rng_state_dp_cp_size")
        want = torch.get_rng_state()
        with TempNamedDir(tmp_path_dist_ckpt / f"rng_{layout}") as ckpt_dir:
            dist_checkpointing.save(state, ckpt_dir, content_metadata=metadata)
            torch.manual_seed(8)
            saved = saved_dp_cp_size(dist_checkpointing.load_content_metadata(ckpt_dir))
            template = {"rng_state": get_rng_state("torch_dist", ONE, ONE, saved_dp_cp_size=saved)}
            loaded = dist_checkpointing.load(template, ckpt_dir)
        assert torch.equal(loaded["rng_state"][0]["torch_rng_state"], want)
