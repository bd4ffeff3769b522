# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import datetime

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
from tests.unit_tests.test_utilities import Utils


class TestMoEMetricsPipelineStageWithoutMoE:
    """PP = 2 where only stage 0 has MoE layers. report() without force_initialize (a library
    user's call) all-reduced stage 0's entries over PP while stage 1, having none, skipped them:
    stage 0 waited forever. The PP group here is a gloo group with a short timeout, so that wait
    fails the test instead of hanging it."""

    def setup_method(self, method):
        if Utils.world_size != 2:
            pytest.skip("needs world size 2 (PP 2)")
        Utils.initialize_model_parallel(1, 2)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    def test_report_without_force_initialize(self):
        pp_ranks = torch.distributed.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group()
        )
        pp_group = torch.distributed.new_group(
            pp_ranks, backend='gloo', timeout=datetime.timedelta(seconds=10)
        )
        pg_collection = ProcessGroupCollection(
            pp=pp_group, dp=parallel_state.get_data_parallel_group()
        )
        tracker = MoEMetricsTracker()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        if stage == 0:
            tracker.record('load_balancing_loss', torch.tensor(0.5), 1, 2)
            tracker.record('z_loss', torch.tensor(0.25), 2, 2)
        try:
            log = tracker.report(
                loss_scale=1.0, iteration=1, num_layers=2, pg_collection=pg_collection
            )
        except RuntimeError as error:  # the PP all-reduce timed out
            log = f'{error}'
        logs = [None, None]
        torch.distributed.all_gather_object(logs, log)
        assert logs[0] == logs[1], logs
        assert 'load_balancing_loss' in log and 'z_loss' in log, logs
