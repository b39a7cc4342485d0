"""Hugging Face integration: a tiny random Llama-style model with gradient checkpointing (no download)."""

from __future__ import annotations

import sys

import pytest
import torch

from conformance.areas.assertions import assert_names_argument
from conformance.harness import optional_packages

pytestmark = pytest.mark.conformance_area("offload")


def _transformers():
    optional_packages.require(("transformers",), "the Hugging Face tests; pip install 'hostoffload[hf]'")
    import transformers

    return transformers


def _tiny_llama(transformers, device, use_reentrant):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_llama_bitwise_equal_with_manager(area_api, accelerator, use_reentrant):
    transformers = _transformers()
    device = accelerator.device()
    model = _tiny_llama(transformers, device, use_reentrant)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    expected = _grads(model, ids)
    manager = area_api.ActivationOffload(
        accelerator=accelerator,
        mode="checkpoint_inputs",
        hf_integration=True,
        min_offload_bytes=0,
        keep_last_count=0,
    )
    for step in range(2):
        with manager:
            actual = _grads(model, ids)
        assert sorted(actual) == sorted(expected)
        for name in expected:
            assert torch.equal(actual[name], expected[name]), f"step {step}: gradient of {name} differs"
    # every decoder layer's hidden-states input is offloaded, each step
    assert manager.stats.tensors_offloaded >= 2 * 3, manager.stats


def test_patch_installed_only_while_active(area_api, accelerator):
    transformers = _transformers()
    layer_cls = transformers.GradientCheckpointingLayer
    before = layer_cls.__dict__.get("__call__")
    manager = area_api.ActivationOffload(accelerator=accelerator, hf_integration=True)
    with manager:
        assert getattr(layer_cls.__call__, "__hostoffload_patch__", False)
        inner = area_api.ActivationOffload(accelerator=accelerator, hf_integration=True)
        with inner:
            pass
        assert getattr(layer_cls.__call__, "__hostoffload_patch__", False), "inner exit removed the outer's patch"
    assert layer_cls.__dict__.get("__call__") is before
    with pytest.raises(KeyError), manager:
        raise KeyError("boom")
    assert layer_cls.__dict__.get("__call__") is before, "patch left behind after an exception"


@pytest.mark.requires(calls=("offload.current_manager",))
def test_missing_transformers_is_a_clear_error_only_when_asked(area_api, accelerator, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    area_api.ActivationOffload(accelerator=accelerator)  # not asked for: no error
    manager = area_api.ActivationOffload(accelerator=accelerator, hf_integration=True)
    with pytest.raises(area_api.MissingDependencyError) as info:
        with manager:
            pass
    assert_names_argument(info.value, "transformers")
    assert not manager.active
    assert area_api.current_manager() is None
