"""Cluster and ModelDims refuse bad values at construction, naming the value and what is accepted."""
import numpy as np
import pytest

from lrmoe.planning import Cluster, ModelDims


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=9), r"ModelDims.top_k must be <= num_experts = 8 \(each token picks top_k distinct experts\), got 9"),
    (dict(top_k=0), r"ModelDims.top_k must be an integer >= 1, got 0"),
    (dict(top_k=2.0), r"ModelDims.top_k must be an integer >= 1, got 2.0"),
    (dict(num_experts=True), r"ModelDims.num_experts must be an integer >= 1, got True"),
    (dict(intermediate=-4), r"ModelDims.intermediate must be an integer >= 1, got -4"),
    (dict(dtype_bytes=0), r"ModelDims.dtype_bytes must be an integer >= 1, got 0"),
    (dict(grad_bytes=-1), r"ModelDims.grad_bytes must be an integer >= 0, got -1"),
    (dict(optimizer_bytes_per_param=1.5), r"ModelDims.optimizer_bytes_per_param must be an integer >= 0, got 1.5"),
])
def test_bad_model_dims(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelDims(**{"hidden": 16, "intermediate": 8, "num_experts": 8, "top_k": 2, **kwargs})


def test_good_model_dims():
    d = ModelDims(16, 8, 8, top_k=8, grad_bytes=0, optimizer_bytes_per_param=0)  # top_k == E is fine
    assert d.top_k == d.num_experts == 8
    assert ModelDims(np.int64(16), 8, np.int32(4), np.int64(1)).num_experts == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_ranks=0), r"Cluster.num_ranks must be an integer >= 1, got 0"),
    (dict(slots_per_rank=2.5), r"Cluster.slots_per_rank must be an integer >= 1, got 2.5"),
    (dict(fast_domains=((0, 1), (1, 2, 3))), r"partition ranks 0..3 into non-empty groups"),
    (dict(fast_domains=((0, 1), (2,))), r"partition ranks 0..3"),
    (dict(fast_domains=((0, 1), (2, 3), ())), r"non-empty groups"),
    (dict(fast_domains=((0, 1.5), (2, 3))), r"groups of integer ranks, e\.g\. \(\(0, 1\), \(2, 3\)\), got"),
    (dict(fast_domains=((0, True), (2, 3))), r"groups of integer ranks"),
    (dict(fast_domains=(0, 1, 2, 3)), r"groups of integer ranks"),
    (dict(fast_domains="0123"), r"groups of integer ranks"),
])
def test_bad_cluster(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster(**{"num_ranks": 4, "slots_per_rank": 2, **kwargs})


def test_good_cluster():
    c = Cluster(4, 2, fast_domains=[[0, 1], np.array([2, 3])])
    assert c.fast_domains == ((0, 1), (2, 3)) and c.domain_G.tolist() == [0, 0, 1, 1]
    assert Cluster(3, 1).fast_domains == ((0, 1, 2),)
