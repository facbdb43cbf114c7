"""`BreakableCUDAGraphCapture` (vLLM's compilation.breakable_cudagraph): never active unless a
capture is open; a capture needs CUDA; on a GPU its graph segments and eager breaks replay in
order on the static buffers."""

import pytest
import torch

from minivllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture


def test_inactive_outside_a_capture():
    assert BreakableCUDAGraphCapture.current() is None
    assert BreakableCUDAGraphCapture.is_active() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_capture_without_cuda_is_refused_and_leaves_nothing_active():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with BreakableCUDAGraphCapture():
            pass
    assert not BreakableCUDAGraphCapture.is_active()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_segments_and_eager_breaks_replay_in_order():
    x = torch.ones(4, device="cuda")
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    calls = []

    def eager() -> None:                    # runs between the two graph segments
        calls.append(1)
        z.copy_(y * 10)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with BreakableCUDAGraphCapture() as cap:
            assert BreakableCUDAGraphCapture.is_active()
            y.copy_(x + 1)
            cap.add_eager(eager)
            z.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    assert (cap.num_graphs, cap.num_eager_breaks) == (2, 1) and not cap.is_active()
    x.fill_(2)
    cap.replay()
    torch.cuda.synchronize()
    assert calls == [1, 1] and torch.equal(z, torch.full_like(z, 31))
