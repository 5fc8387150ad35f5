// One decode token of Mamba-2's selective state space, in place on a batch of state slots: the
// CPU kernel behind mamba_state_update. Each (row, head) reads its slot's [p, n] float32 state once,
// decays it, adds the token's outer product and reads it out against C in the same pass, and
// writes it back: no gathered copy of the states, no intermediate tensors.
//
// torch.ops.mcore_kernels_cpu.mamba_state_update(states [S, h, p, n] float32 (updated), slots [b]
//     int64, x [b, h, p], dt [b, h], A [h], B [b, g, n], C [b, g, n], D [h]?) -> y [b, h, p] float32:
//     s = states[slots[r], k]; s = exp(dt[r, k] A[k]) s + dt[r, k] x[r, k] (outer) B[r, k / (h / g)];
//     y[r, k] = s C[r, k / (h / g)] + D[k] x[r, k].
// Inputs other than states are read as float32 (the wrapper converts them). A slot past S, or
// named twice, is an error (ValueError in Python), checked before any state changes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {

constexpr const char* kOp = "mamba_state_update";

void check_float(const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), kOp, ": ", name,
              " must be a contiguous float32 tensor");
  TORCH_CHECK(t.sizes().vec() == shape, kOp, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
}

void check_slots(const at::Tensor& slots, int64_t num_slots) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(), kOp,
              ": slots must be a contiguous int64 [b] tensor");
  std::vector<char> named(num_slots, 0);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.size(0); ++r) {
    TORCH_CHECK_VALUE(s[r] >= 0 && s[r] < num_slots, kOp, ": slot ", s[r], " is not one of the ", num_slots,
                      " state slots");
    TORCH_CHECK_VALUE(!named[s[r]], kOp, ": slot ", s[r], " is named twice");
    named[s[r]] = 1;
  }
}

at::Tensor mamba_state_update(at::Tensor states, const at::Tensor& slots, const at::Tensor& x, const at::Tensor& dt,
                              const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                              const std::optional<at::Tensor>& D) {
  TORCH_CHECK(states.dim() == 4, kOp, ": states must be [S, h, p, n]");
  const int64_t num_slots = states.size(0), h = states.size(1), p = states.size(2), n = states.size(3);
  const int64_t b = slots.numel();
  TORCH_CHECK(B.dim() == 3 && B.size(1) > 0 && h % B.size(1) == 0, kOp, ": B must be [b, g, n] with g dividing h");
  const int64_t g = B.size(1), per_group = h / g;
  check_float(states, "states", {num_slots, h, p, n});
  check_float(x, "x", {b, h, p});
  check_float(dt, "dt", {b, h});
  check_float(A, "A", {h});
  check_float(B, "B", {b, g, n});
  check_float(C, "C", {b, g, n});
  if (D.has_value()) check_float(*D, "D", {h});
  check_slots(slots, num_slots);
  at::Tensor y = at::empty({b, h, p}, x.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* state = states.data_ptr<float>();
  const float *xs = x.data_ptr<float>(), *dts = dt.data_ptr<float>(), *As = A.data_ptr<float>();
  const float *Bs = B.data_ptr<float>(), *Cs = C.data_ptr<float>();
  const float* Ds = D.has_value() ? D->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rk = begin; rk < end; ++rk) {
      const int64_t r = rk / h, k = rk % h, group = k / per_group;
      const float step = dts[rk], decay = std::exp(step * As[k]), skip = Ds ? Ds[k] : 0.f;
      const float* __restrict Bv = Bs + (r * g + group) * n;
      const float* __restrict Cv = Cs + (r * g + group) * n;
      float* __restrict s = state + (slot[r] * h + k) * p * n;
      for (int64_t i = 0; i < p; ++i, s += n) {
        const float xi = xs[rk * p + i], input = step * xi;
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          const float v = decay * s[j] + input * Bv[j];
          s[j] = v;
          total += v * Cv[j];
        }
        ys[rk * p + i] = total + skip * xi;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def(
      "mamba_state_update(Tensor(a!) states, Tensor slots, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("mamba_state_update", &mamba_state_update); }
