// The K-quant GEMM of one layer and the blocks' dequantization (formats and arithmetic:
// kquant.h). Threads split the output rows (16-row spans, over the parts of a fused weight). Each row's
// decoded chunk is used by kGemmRowsKQ activation rows at once; x's codes are read in chunks
// of rows that fit in L2, so a batch-1 step reads each weight byte once and a prefill reads
// it once per chunk of rows.
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "kquant.h"
#include "pagedllm_abi.h"
#include "parallel.h"

using namespace kquant;

extern "C" {

int64_t kquant_row_bytes(int64_t type, int64_t K) { return row_bytes(type, K); }

int linear_kquant(const float* x, int64_t ldx, const KQuantWeight* w, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K) {
  if (!fits(*w, N, K)) return -1;
  if (M <= 0 || N == 0) return 0;
  const std::vector<Span> spans = spans_of(*w);
  const QuantizedX xq(x, ldx, M, K);
  // Rows of x in chunks whose codes fit in L2, each chunk over every weight row.
  const int64_t chunk = chunk_rows(xq.kp), num_spans = static_cast<int64_t>(spans.size());
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    par::parallel_for(num_spans, [&](int64_t s) {
      const Span& span = spans[s];
      rows_times_x(w->parts[span.part], span.n0, span.n1, span.col, K, xq, m0, rows, bias, y, N);
    });
  }
  return 0;
}

int kquant_dequantize(int64_t type, const void* blocks, const int64_t* rows, int64_t R, int64_t K, float* out) {
  const int64_t rb = row_bytes(type, K);
  if (rb == 0) return -1;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    par::parallel_for(R, [&](int64_t r) {
      const uint8_t* row = static_cast<const uint8_t*>(blocks) + (rows ? rows[r] : r) * rb;
      for (int64_t u = 0; u < (K + UNIT - 1) / UNIT; ++u) {
        const int chunks = int(std::min(UNIT, K - u * UNIT) / CHUNK);
        const uint8_t* b = F::unit(row, u);
        F32x16 ws, off;
        F::scales(b, chunks, ws, off);
        float wsa[16], offa[16];
        store(wsa, ws), store(offa, off);
        for (int c = 0; c < chunks; ++c) {
          uint8_t q[64];
          store_u8x64(q, F::codes(b, c));
          for (int i = 0; i < 4; ++i) {
            const F32x16 v = F::kSigned ? load_s8_f32(reinterpret_cast<const int8_t*>(q + 16 * i)) : load_u8_f32(q + 16 * i);
            store(out + r * K + u * UNIT + c * CHUNK + 16 * i, fma(v, set1(wsa[4 * c + i]), set1(offa[4 * c + i])));
          }
        }
      }
    });
  });
  return 0;
}

}  // extern "C"
