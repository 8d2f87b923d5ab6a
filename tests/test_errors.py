"""Every bad input raises a clear error at trace time, naming the fix."""

import jax
import jax.numpy as jnp
import pytest
from helpers import example_mean_loss, make_data, make_params, mesh_of, put, weighted_loss
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum


@pytest.mark.parametrize("bad, error, match", [
    (0, ValueError, "positive int"),
    (-2, ValueError, "positive int"),
    (2.0, TypeError, "positive int"),
    (True, TypeError, "bool"),
    ("4", TypeError, "positive int"),
])
def test_bad_micro_batches(bad, error, match):
  with pytest.raises(error, match=match):
    fxaccum.value_and_grad(example_mean_loss, micro_batches=bad)


def test_batch_not_divisible_names_sizes():
  with pytest.raises(ValueError, match=r"leading size 64 is not divisible by micro_batches=5"):
    fxaccum.value_and_grad(example_mean_loss, micro_batches=5)(make_params(), make_data(k=1))


def test_batch_leaves_with_different_sizes():
  data = make_data(k=1)
  data["y"] = data["y"][:32]
  with pytest.raises(ValueError, match=r"different leading sizes.*\['y'\]: 32"):
    fxaccum.value_and_grad(example_mean_loss, micro_batches=2)(make_params(), data)


def test_zero_sized_per_device_micro_batch():
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  data = {k: v[:16] for k, v in make_data(k=1).items()}
  specs = {"x": P("data"), "y": P("data"), "mask": P("data")}
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"per-device micro-batch of 0.5"):
    jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=4))(
        make_params(), put(data, mesh, specs))


def test_unknown_data_axis():
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"\['batch'\].*axes are \('data',\)"):
    jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=2, data_axes="batch"))(
        make_params(), make_data(k=2))


def test_data_axes_without_mesh():
  with pytest.raises(ValueError, match="no mesh was found"):
    fxaccum.value_and_grad(weighted_loss, micro_batches=2, data_axes="data")(
        make_params(), make_data(k=2))


def test_integer_differentiated_leaf():
  params = make_params()
  params["steps"] = jnp.int32(3)
  with pytest.raises(TypeError, match=r"float inputs.*\['steps'\].*int32"):
    fxaccum.value_and_grad(example_mean_loss, micro_batches=2)(params, make_data(k=2))


def test_has_aux_true_but_no_aux():
  with pytest.raises(TypeError, match=r"has_aux=True.*returned Weighted"):
    fxaccum.value_and_grad(weighted_loss, has_aux=True, micro_batches=2)(
        make_params(), make_data(k=2))


def test_aux_returned_without_has_aux():
  with pytest.raises(TypeError, match="pass has_aux=True"):
    fxaccum.value_and_grad(lambda p, b: (example_mean_loss(p, b), {}), micro_batches=2)(
        make_params(), make_data(k=2))


def test_non_scalar_loss():
  with pytest.raises(TypeError, match="float scalar"):
    fxaccum.value_and_grad(lambda p, b: p["b1"], micro_batches=2)(make_params(), make_data(k=2))


def test_argnums_overlapping_batch():
  with pytest.raises(ValueError, match="argnums and batch_argnums overlap"):
    fxaccum.value_and_grad(example_mean_loss, argnums=(0, 1), micro_batches=2)


def test_argnums_out_of_range():
  with pytest.raises(TypeError, match="refer to argument 1"):
    fxaccum.value_and_grad(lambda p: jnp.sum(p["b1"]), micro_batches=2)(make_params())


def test_bad_fsdp_and_rng_leaf():
  with pytest.raises(ValueError, match="fsdp must be one of"):
    fxaccum.value_and_grad(example_mean_loss, micro_batches=2, fsdp="sometimes")
  with pytest.raises(TypeError, match="PRNG keys"):
    fxaccum.value_and_grad(lambda p, b, key: example_mean_loss(p, b), micro_batches=2,
                           rng_argnums=2)(make_params(), make_data(k=2), jnp.ones(3))
