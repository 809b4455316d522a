// Read rates of a paged KV cache's access patterns on one core: the ceiling each order of reads
// leaves the decode kernel (kernels/cpu_ext/paged_decode.cpp), printed against a contiguous read of
// the same bytes measured in the same run.
//
//   gcc -O3 -march=native bench/kv_read.c -o /tmp/kv_read && /tmp/kv_read [KVH [D [MB]]]
//
// A float32 cache of MB megabytes (default 96) in blocks of 16 tokens x KVH heads x D dims
// (defaults 3 x 64: SmolLM2-135M), blocks in a shuffled order (as a block table hands them out
// after a while), read in sequences of 32 blocks. Each pattern only sums what it reads (the
// kernel's arithmetic left out), best of 5 passes:
//   contiguous       the whole cache front to back (the hardware prefetchers' best case)
//   blocks           whole blocks, shuffled, no software prefetch
//   blocks+pf        whole blocks, shuffled, the block two ahead prefetched (all heads at once:
//                    the kernel's per-sequence items)
//   head rows+pf     per sequence, one KV head at a time over all its blocks, that head's rows of
//                    the block two ahead prefetched (the kernel's per-(sequence, head) items in
//                    our [block, token, head, dim] layout: a head's 16 rows D floats apart)
//   head block+pf    the same order over a [block, head, token, dim] cache (vLLM's CPU layout:
//                    a head's rows of a block contiguous)
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float vf __attribute__((vector_size(64)));
enum { BS = 16, SEQ_BLOCKS = 32, LINE = 64, REPEATS = 5 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline vf load(const float* p) { return *(const vf*)p; }

static inline void prefetch(const float* p, long floats) {
  for (long off = 0; off < floats; off += LINE / 4) __builtin_prefetch(p + off, 0, 1);
}

typedef struct {
  float* cache;
  const long* perm;  // block order
  long nb, kvh, d, blk;  // blocks, KV heads, dims, floats a block
} Cache;

static vf contiguous(const Cache* c) {
  vf acc = {0};
  for (long i = 0; i < c->nb * c->blk; i += 16) acc += load(c->cache + i);
  return acc;
}

static vf blocks(const Cache* c, int pf) {
  vf acc = {0};
  for (long b = 0; b < c->nb; ++b) {
    const float* p = c->cache + c->perm[b] * c->blk;
    const float* q = pf && b + 2 < c->nb ? c->cache + c->perm[b + 2] * c->blk : NULL;
    for (long i = 0; i < c->blk; i += 16) {
      if (q != NULL && i % (LINE / 4) == 0) __builtin_prefetch(q + i, 0, 1);
      acc += load(p + i);
    }
  }
  return acc;
}

// One head at a time per sequence of SEQ_BLOCKS blocks; `head_major`: the cache as [block, head,
// token, dim] (a head's rows contiguous), else [block, token, head, dim].
static vf head_rows(const Cache* c, int head_major) {
  vf acc = {0};
  const long row_stride = head_major ? c->d : c->kvh * c->d, head_stride = head_major ? BS * c->d : c->d;
  const long seqs = c->nb / SEQ_BLOCKS, passes = seqs * c->kvh * SEQ_BLOCKS;
  for (long s = 0; s < seqs; ++s) {
    for (long h = 0; h < c->kvh; ++h) {
      for (long j = 0; j < SEQ_BLOCKS; ++j) {
        const float* p = c->cache + c->perm[s * SEQ_BLOCKS + j] * c->blk + h * head_stride;
        const long ahead = (s * c->kvh + h) * SEQ_BLOCKS + j + 2;  // two blocks on, across passes
        const float* q = NULL;
        if (ahead < passes) {
          const long as = ahead / (c->kvh * SEQ_BLOCKS), ah = ahead / SEQ_BLOCKS % c->kvh, aj = ahead % SEQ_BLOCKS;
          q = c->cache + c->perm[as * SEQ_BLOCKS + aj] * c->blk + ah * head_stride;
        }
        for (long t = 0; t < BS; ++t) {
          if (q != NULL) prefetch(q + t * row_stride, c->d);
          for (long i = 0; i < c->d; i += 16) acc += load(p + t * row_stride + i);
        }
      }
    }
  }
  return acc;
}

typedef vf (*Pattern)(const Cache*, int);
static vf run_contiguous(const Cache* c, int unused) { (void)unused; return contiguous(c); }

int main(int argc, char** argv) {
  const long kvh = argc > 1 ? atol(argv[1]) : 3, d = argc > 2 ? atol(argv[2]) : 64;
  const long mb = argc > 3 ? atol(argv[3]) : 96;
  if (kvh < 1 || d < 16 || d % 16 != 0 || mb < 1) {
    fprintf(stderr, "usage: kv_read [KVH >= 1 [D, a multiple of 16 [MB]]]\n");
    return 2;
  }
  Cache c = {.kvh = kvh, .d = d, .blk = BS * kvh * d};
  c.nb = (mb << 20) / (long)sizeof(float) / c.blk / SEQ_BLOCKS * SEQ_BLOCKS;
  const size_t bytes = (size_t)c.nb * (size_t)c.blk * sizeof(float);
  c.cache = aligned_alloc(LINE, bytes);
  long* perm = malloc((size_t)c.nb * sizeof(long));
  if (c.cache == NULL || perm == NULL) return 1;
  for (size_t i = 0; i < bytes / sizeof(float); ++i) c.cache[i] = (float)(i % 7);
  srand(1);
  for (long i = 0; i < c.nb; ++i) perm[i] = i;
  for (long i = c.nb - 1; i > 0; --i) {
    const long j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  c.perm = perm;
  const char* names[] = {"contiguous", "blocks", "blocks+pf", "head rows+pf", "head block+pf"};
  const Pattern patterns[] = {run_contiguous, blocks, blocks, head_rows, head_rows};
  const int args[] = {0, 0, 1, 0, 1};
  double best[5];
  float sink = 0;
  for (int p = 0; p < 5; ++p) best[p] = 1e30;
  for (int r = 0; r < REPEATS; ++r) {  // patterns interleaved: a load that comes and goes hits all
    for (int p = 0; p < 5; ++p) {
      const double t0 = now();
      const vf acc = patterns[p](&c, args[p]);
      const double took = now() - t0;
      best[p] = best[p] < took ? best[p] : took;
      for (int i = 0; i < 16; ++i) sink += acc[i];
    }
  }
  printf("float32 cache %.0f MB, blocks of %d tokens x %ld KV heads x %ld dims, shuffled; one core, best of %d\n",
         bytes / 1048576.0, BS, kvh, d, REPEATS);
  for (int p = 0; p < 5; ++p) {
    printf("  %-14s %6.1f GB/s  %.2f of contiguous\n", names[p], bytes / best[p] / 1e9, best[0] / best[p]);
  }
  return sink == 0.5f;  // keeps the sums: a read whose result is unused would be optimized away
}
