"""The small facts written once in `rl3d.utils`: the registry mechanism every "name it in a
recipe" table uses, the dtype map, the free-port helper."""

import socket

import pytest
import torch

from rl3d.utils.dtypes import DTYPE_BYTES, torch_dtype
from rl3d.utils.net import free_port
from rl3d.utils.registry import Registry


def test_registry_iterates_in_registration_order_and_names_sorted():
    reg: Registry[int] = Registry("thing")
    reg.register("zeta", 1)
    reg.register("alpha")(2)
    assert list(reg) == ["zeta", "alpha"] and reg.names() == ("alpha", "zeta")
    assert reg.get("alpha") == 2 and reg["zeta"] == 1 and reg.values() == (1, 2) and len(reg) == 2


def test_registry_unknown_name_suggests_and_ends_with_the_note():
    reg: Registry[int] = Registry("strategy", note="(more on `import x`)")
    reg.register("hybridflow", 1)
    with pytest.raises(ValueError) as err:
        reg.get("hybridflw")
    assert str(err.value) == (
        "unknown strategy 'hybridflw' (did you mean 'hybridflow'?); known: hybridflow (more on `import x`)"
    )


def test_registry_takes_the_same_class_again_and_refuses_another():
    reg: Registry[type] = Registry("tool")

    def make():  # the same class defined twice: a module imported a second time
        class Echo:
            pass

        return Echo

    first, again = make(), make()
    reg.register("echo", first)
    reg.register("echo", again)
    assert reg.get("echo") is again
    with pytest.raises(AssertionError, match="tool 'echo' registered twice"):
        reg.register("echo", int)


def test_dtype_bytes_are_the_torch_dtypes_sizes():
    for name, nbytes in DTYPE_BYTES.items():
        assert torch_dtype(name).itemsize == nbytes, name
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match=r"unknown dtype 'bfloat61' \(did you mean 'bfloat16'\?\)"):
        torch_dtype("bfloat61")


def test_free_port_can_be_bound():
    port = free_port("127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
