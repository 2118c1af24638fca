"""The shipped trained drafters on a (data x model) mesh: the embedded target sharded 2 x 4 over the
simulated CPU devices decodes exactly what it decodes on one device, for each drafter kind it ships."""
import jax
import pytest

import jaxdecode
from jaxdecode.model import embedded_model_path
from jaxdecode.sharding import make_mesh

PROMPTS = ["def add(a, b):\n", "import os\n", "class Foo:\n    def", "for i in range("]  # 4 rows: data=2


@pytest.mark.slow  # the embedded target, five drafters: ~4 minutes on 2 cores
@pytest.mark.parametrize("drafter", ["hydra", "medusa", "eagle3", "accept_head", "retrieval"])
def test_shipped_drafters_on_a_mesh_equal_one_device(drafter):
    assert (embedded_model_path() / "drafters" / drafter / "config.json").exists()
    mesh = make_mesh(data=2, model=4, devices=jax.devices()[:8])
    kw = dict(method="speculative", drafter=drafter, max_new_tokens=8, adaptive=False)
    one = jaxdecode.generate(jaxdecode.load(), PROMPTS, **kw)
    sharded = jaxdecode.generate(jaxdecode.load(mesh=mesh), PROMPTS, mesh=mesh, **kw)
    assert [r.tokens for r in sharded] == [r.tokens for r in one]
