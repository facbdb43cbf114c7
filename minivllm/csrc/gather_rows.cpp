// Row gather out[i] = table[ids[i]] (an embedding lookup, of any row type: bf16 rows, or the
// packed block rows of a GGUF table before dequantisation).
//
// torch's embedding / index_select is one op too, but it is not a native call: a CPU graph
// (compilation/cpu_graph.py) records only native calls, so the lookup that starts every decode
// step has to be one.

#include <cstdint>
#include "kernels.h"
#include <cstring>

extern "C" {

// table: num_table_rows rows of row_bytes, table_stride bytes apart; ids int64 [n]; out rows
// out_stride bytes apart. Returns 0; 1: an id outside the table (nothing is written then).
int minivllm_gather_rows(const uint8_t* table, int64_t table_stride, int64_t num_table_rows,
                         const int64_t* ids, int64_t n, int64_t row_bytes, uint8_t* out,
                         int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= num_table_rows) return 1;
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + i * out_stride, table + ids[i] * table_stride, row_bytes);
  return 0;
}

}  // extern "C"
