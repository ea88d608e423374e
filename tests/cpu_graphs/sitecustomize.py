"""CUDA-graph decode built on CPU too, in every Python process started with this folder on
PYTHONPATH: a test's server, its engine processes and their ranks, which the test cannot reach
otherwise. Python imports `sitecustomize` at start-up; this one widens
`dsaserve/engine/decode/cuda_graph.py`'s `GRAPH_DEVICES` seam, so each rank runs the padded
static step a graph would replay, eagerly (tests/test_cuda_graph_decode.py)."""

from dsaserve.engine.decode import cuda_graph

cuda_graph.GRAPH_DEVICES = ("cuda", "cpu")
