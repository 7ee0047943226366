"""How the producer cuts a step's prompts into generation requests by default."""

import pytest

from distrl.cluster.producer import default_chunk


@pytest.mark.parametrize("prompts,actors,k,chunk", [
    (8, 2, 0, 4),   # synchronous: one chunk per engine per step
    (8, 2, 1, 2),   # asynchronous: two, so engines switch weights between them
    (8, 3, 0, 3),   # rounded up: the last engine takes the rest
    (8, 3, 2, 2),
    (1, 4, 1, 1),   # never empty
])
def test_default_chunk(prompts, actors, k, chunk):
    assert default_chunk(prompts, actors, k) == chunk
