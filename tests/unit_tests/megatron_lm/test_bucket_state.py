"""megatron-core's bucket layout as the plug-in recovers it from the stored bucket sizes (bucket_state.py). Against
megatron-core's own DistributedOptimizer checkpoints: test_plugin.py's
test_a_run_switches_from_megatrons_default_bucket_layout_with_its_state."""
import pytest

from megatron_ext.megatron_lm.bucket_state import BucketLayoutError, bucket_offsets


def test_parameters_start_64_aligned_and_buckets_close_where_they_are_full():
    params = [("a", 100), ("b", 30), ("c", 64), ("d", 1)]
    # a bucket closes after the parameter that fills it (its size: that parameter's end, unpadded)
    assert bucket_offsets(params, [158, 65]) == {"a": (0, 0), "b": (0, 128), "c": (1, 0), "d": (1, 64)}
    # or, before a shared embedding, at the 64-aligned end of the last one (the padding counted in its size; where
    # that end is not the last parameter's, megatron-core 0.16.1 cannot save the bucket in dp_reshardable: it pads
    # the shard past the unpadded size, which DCP refuses, so only this hand-made layout has it)
    assert bucket_offsets(params, [192, 65]) == {"a": (0, 0), "b": (0, 128), "c": (1, 0), "d": (1, 64)}


def test_one_bucket_holds_everything_at_aligned_starts():
    assert bucket_offsets([("a", 100), ("b", 30), ("c", 64), ("d", 1)], [257]) == {
        "a": (0, 0), "b": (0, 128), "c": (0, 192), "d": (0, 256)}


@pytest.mark.parametrize("sizes, why", [
    ([150], "b .* would lie at element 128 of bucket 0 of 150 elements"),    # a bucket too small
    ([158], "c .* would lie at element 0 of a bucket after the last"),      # too few buckets
    ([158, 64, 10], "the parameters fill 2 of 3 buckets"),                 # a bucket no parameter fills
    ([158, 70], "the parameters fill 1 of 2 buckets and 65 elements of the next"),   # a bucket not filled
])
def test_a_layout_that_is_not_megatron_cores_is_refused(sizes, why):
    with pytest.raises(BucketLayoutError, match=why):
        bucket_offsets([("a", 100), ("b", 30), ("c", 64), ("d", 1)], sizes)
