/* aiokv's native helper: the planner, which turns one job's block and chunk ids into its
 * whole program (sort, runs, slices, launches, copy tables) in C, on the submitting thread,
 * and hands it to the lane's issuer. See _native.h.
 *
 * It mirrors the Python plan exactly (tests/test_cuda_native_plan.py compares the calls of
 * both on random jobs): ``map_blocks``' checks of one group of one block per chunk,
 * ``plan_copies`` (page-major copies merged where both sides are contiguous),
 * ``MultiStreamDma.split`` and ``issue`` (byte-balanced slices forked over the lane's DMA
 * streams), and the staged strategy's ``prepare`` choice, ``block_job`` and ``enqueue``. Any
 * job it does not cover (bad input among them: the Python plan then raises the error it
 * always raised) comes back as None, and the lane plans it in Python. */
#include "_native.h"

#define MAX_STREAMS 64 /* DMA streams a lane may spread a job over here (more: the Python plan) */
#define ROWS_PER_LAUNCH 256
#define PARAMS 9
#define BLOB_BYTES (44 + 4 * ROWS_PER_LAUNCH)
#define TILE_BYTES 16384
#define MAX_TILES ((uint64_t)0x7fffffff)
#define US_PER_CALL 1.5
#define US_PER_DESCRIPTOR 0.8

static const uint64_t PARAM_OFFSETS[PARAMS] = {0, 8, 16, 24, 28, 32, 36, 40, 44};

typedef struct {
    uint64_t tensor, base, stride, size, offset; /* one page of a block, in the layout's order */
} PageRef;

typedef struct {
    size_t off, len;
} BufRef;

/* A program being built: rows, and buffers in one growing arena (copied out at the end). */
typedef struct {
    uint64_t *rows;
    Py_ssize_t nrows, rcap;
    BufRef *bufs;
    Py_ssize_t nbuf, bcap;
    unsigned char *data;
    size_t used, dcap;
    double cost;
    int oom;
} Builder;

typedef struct {
    PyObject_HEAD
    PyObject *issuer;
    int to_host;
    PageRef *pages;
    Py_ssize_t npages;
    uint64_t chunk_bytes, host_base, num_chunks, num_blocks, block_bytes;
    uint64_t main, rescue;
    int nsubs, max_streams;
    uint64_t subs[MAX_STREAMS], joins[MAX_STREAMS];
    uint64_t min_slice_bytes, min_slice_descriptors;
    double run_here_us;
    /* staged: the lane's ring (``set_staging``) and the layout's page table on the device */
    int staged, gains_only, has_shape;
    uint64_t kstream, dstream, full[2], free_[2], joined, function;
    uint64_t ring, slot_bytes, page_table, st_npages, longest;
    uint64_t min_staged_pieces, direct_piece_bytes, max_ctas;
    long long staged_jobs;
    int next_slot, last_staged;
    /* scratch, reused by every job */
    int64_t *gpu, *chunk, *sgpu, *schunk, *tmp;
    size_t gcap, kcap, scap;
    uint64_t *cdev, *chost, *csize, *ctensor;
    size_t ccap;
    uint32_t *seen;
    uint32_t stamp;
    Builder b;
} PlannerObject;

/* ------------------------------------------------------------------------ builder */

static int
grow(void **p, size_t *cap, size_t need, size_t item)
{
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap : 64;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, n * item);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = n;
    return 0;
}

static void
row(Builder *b, uint64_t op, uint64_t a, uint64_t c, uint64_t d, uint64_t e, uint64_t f, uint64_t g,
    uint64_t h)
{
    size_t cap = (size_t)b->rcap;
    if (b->oom || grow((void **)&b->rows, &cap, (size_t)(b->nrows + 1) * WORDS, sizeof(uint64_t)) < 0) {
        b->oom = 1;
        return;
    }
    b->rcap = (Py_ssize_t)cap;
    uint64_t *o = b->rows + b->nrows * WORDS;
    o[0] = op, o[1] = a, o[2] = c, o[3] = d, o[4] = e, o[5] = f, o[6] = g, o[7] = h;
    b->nrows++;
    b->cost += US_PER_CALL;
}

/* Room for a buffer of ``len`` bytes: its index, or -1 (out of memory). Write it through
 * ``buf_at`` before the next buffer is added (the arena may move). */
static Py_ssize_t
buf_new(Builder *b, size_t len)
{
    size_t bcap = (size_t)b->bcap, need = b->used + ((len + 15) & ~(size_t)15);
    if (b->oom || grow((void **)&b->bufs, &bcap, (size_t)b->nbuf + 1, sizeof(BufRef)) < 0 ||
        grow((void **)&b->data, &b->dcap, need ? need : 16, 1) < 0) {
        b->oom = 1;
        return -1;
    }
    b->bcap = (Py_ssize_t)bcap;
    b->bufs[b->nbuf] = (BufRef){b->used, len};
    b->used = need;
    return b->nbuf++;
}

static void *
buf_at(Builder *b, Py_ssize_t id)
{
    return b->data + b->bufs[id].off;
}

/* ------------------------------------------------------------------------- ids */

/* ``obj`` as int64 ids in ``*out`` (grown to fit): 0, 1 when it is not a form planned here
 * (the Python plan then reads it, and raises for what is wrong), -1 on an error. */
static int
read_ids(PyObject *obj, int64_t **out, size_t *cap, Py_ssize_t *n)
{
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(obj);
        if (grow((void **)out, cap, (size_t)(len ? len : 1), sizeof(int64_t)) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t i = 0; i < len; i++) {
            if (!PyLong_CheckExact(items[i]))
                return 1;
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return 1;
            }
            (*out)[i] = v;
        }
        *n = len;
        return 0;
    }
    if (!PyObject_CheckBuffer(obj))
        return 1;
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 1;
    }
    int r = 1;
    const char *f = v.format ? v.format : "B";
    if (*f == '@' || *f == '=')
        f++;
#if PY_BIG_ENDIAN
    if (*f == '>' || *f == '!')
        f++;
#else
    if (*f == '<')
        f++;
#endif
    if (v.ndim != 1 || f[0] == '\0' || f[1] != '\0' || strchr("bBhHiIlLqQnN", f[0]) == NULL)
        goto done;
    Py_ssize_t len = v.len / v.itemsize;
    if (grow((void **)out, cap, (size_t)(len ? len : 1), sizeof(int64_t)) < 0) {
        PyErr_NoMemory();
        r = -1;
        goto done;
    }
    int is_unsigned = f[0] >= 'A' && f[0] <= 'Z';
    for (Py_ssize_t i = 0; i < len; i++) {
        const char *at = (const char *)v.buf + i * v.itemsize;
        int64_t x;
        switch (v.itemsize) {
        case 1:
            x = is_unsigned ? (int64_t)*(const uint8_t *)at : (int64_t)*(const int8_t *)at;
            break;
        case 2:
            x = is_unsigned ? (int64_t)*(const uint16_t *)at : (int64_t)*(const int16_t *)at;
            break;
        case 4:
            x = is_unsigned ? (int64_t)*(const uint32_t *)at : (int64_t)*(const int32_t *)at;
            break;
        case 8:
            if (is_unsigned && *(const uint64_t *)at > (uint64_t)INT64_MAX)
                goto done; /* not an int64 id: the Python plan says so */
            x = *(const int64_t *)at;
            break;
        default:
            goto done;
        }
        (*out)[i] = x;
    }
    *n = len;
    r = 0;
done:
    PyBuffer_Release(&v);
    return r;
}

/* Stable sort of (chunk, gpu) pairs by chunk: insertion for a few, else merge. */
static void
sort_pairs(int64_t *chunk, int64_t *gpu, int64_t *tmp, Py_ssize_t n)
{
    if (n <= 24) {
        for (Py_ssize_t i = 1; i < n; i++) {
            int64_t c = chunk[i], g = gpu[i];
            Py_ssize_t j = i;
            for (; j > 0 && chunk[j - 1] > c; j--) {
                chunk[j] = chunk[j - 1];
                gpu[j] = gpu[j - 1];
            }
            chunk[j] = c;
            gpu[j] = g;
        }
        return;
    }
    Py_ssize_t half = n / 2;
    sort_pairs(chunk, gpu, tmp, half);
    sort_pairs(chunk + half, gpu + half, tmp, n - half);
    if (chunk[half - 1] <= chunk[half])
        return;
    int64_t *tc = tmp, *tg = tmp + n;
    Py_ssize_t i = 0, j = half, k = 0;
    while (i < half && j < n) {
        if (chunk[j] < chunk[i]) {
            tc[k] = chunk[j], tg[k++] = gpu[j++];
        } else {
            tc[k] = chunk[i], tg[k++] = gpu[i++];
        }
    }
    while (i < half)
        tc[k] = chunk[i], tg[k++] = gpu[i++];
    while (j < n)
        tc[k] = chunk[j], tg[k++] = gpu[j++];
    memcpy(chunk, tc, (size_t)n * sizeof(int64_t));
    memcpy(gpu, tg, (size_t)n * sizeof(int64_t));
}

/* ------------------------------------------------------------------ dma plan */

static uint64_t
flags_of(const PlannerObject *p)
{
    return 1 | (p->to_host ? 2 : 0); /* stream-ordered; bit 1: to host */
}

/* Copies [lo, hi) of the tables (buffers dst, dst + 1, dst + 2) on ``stream``: a plain copy
 * for one (cheaper to enqueue than a batch of one), else a batch. */
static void
put(const PlannerObject *p, Builder *b, Py_ssize_t dst, uint64_t lo, uint64_t hi, uint64_t stream)
{
    if (hi - lo == 1) {
        const uint64_t *d = buf_at(b, dst), *s = buf_at(b, dst + 1), *z = buf_at(b, dst + 2);
        row(b, OP_COPY, stream, d[lo], s[lo], z[lo], 0, 0, 0);
    } else if (hi > lo) {
        row(b, OP_BATCH, stream, (uint64_t)dst, (uint64_t)dst + 1, (uint64_t)dst + 2, hi - lo, flags_of(p), lo);
        b->cost += US_PER_DESCRIPTOR * (double)(hi - lo);
    }
}

static int
grow_copies(PlannerObject *p, size_t need)
{
    if (need <= p->ccap)
        return 0;
    size_t n = p->ccap ? p->ccap : 256;
    while (n < need)
        n *= 2;
    uint64_t **tables[] = {&p->cdev, &p->chost, &p->csize, &p->ctensor};
    for (size_t i = 0; i < 4; i++) {
        uint64_t *q = realloc(*tables[i], n * sizeof(uint64_t));
        if (q == NULL)
            return -1;
        *tables[i] = q;
    }
    p->ccap = n;
    return 0;
}

/* ``byte_splits``: cut ``m`` copies into ``parts`` slices of about equal bytes. */
static int
byte_splits(const uint64_t *sizes, Py_ssize_t m, int parts, uint64_t *bounds)
{
    if (parts > m)
        parts = (int)m;
    if (parts < 1)
        parts = 1;
    bounds[0] = 0;
    if (parts == 1) {
        bounds[1] = (uint64_t)m;
        return 1;
    }
    int equal = 1;
    for (Py_ssize_t i = 1; i < m && equal; i++)
        equal = sizes[i] == sizes[0];
    if (equal) {
        for (int i = 1; i <= parts; i++)
            bounds[i] = (uint64_t)m * (uint64_t)i / (uint64_t)parts;
        return parts;
    }
    /* cum = cumsum(sizes); cut i = searchsorted(cum, total * i // parts, "left") + 1, then
     * the sorted set of {0, m, min(cut, m)}. The targets ascend, so the cuts do too. */
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++)
        total += sizes[i];
    int nb = 1;
    uint64_t cum = 0;
    Py_ssize_t at = 0; /* first index whose cumsum >= target */
    cum = sizes[0];
    for (int i = 1; i < parts; i++) {
        uint64_t target = (uint64_t)((unsigned __int128)total * (unsigned)i / (unsigned)parts);
        while (at < m && cum < target) {
            at++;
            if (at < m)
                cum += sizes[at];
        }
        uint64_t cut = (uint64_t)at + 1;
        if (cut > (uint64_t)m)
            cut = (uint64_t)m;
        if (cut != bounds[nb - 1])
            bounds[nb++] = cut;
    }
    if (bounds[nb - 1] != (uint64_t)m)
        bounds[nb++] = (uint64_t)m;
    return nb - 1;
}

/* ``plan_copies`` (page-major, merged where both sides are contiguous), then
 * ``MultiStreamDma.split`` and ``issue`` between the records of ``start`` and ``stop`` on
 * the main stream, behind a wait on ``dep``. The ids are in job order. */
static int
plan_dma(PlannerObject *p, Builder *b, Py_ssize_t n, uint64_t start, uint64_t stop, uint64_t dep)
{
    if (grow_copies(p, (size_t)n * (size_t)p->npages) < 0)
        return -1;
    Py_ssize_t m = 0;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < p->npages; k++) {
        const PageRef *pg = &p->pages[k];
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t dev = pg->base + (uint64_t)p->gpu[i] * pg->stride;
            uint64_t host = (uint64_t)p->chunk[i] * p->chunk_bytes + pg->offset;
            total += pg->size;
            if (m && p->ctensor[m - 1] == pg->tensor && p->cdev[m - 1] + p->csize[m - 1] == dev &&
                p->chost[m - 1] + p->csize[m - 1] == host) {
                p->csize[m - 1] += pg->size;
                continue;
            }
            p->ctensor[m] = pg->tensor;
            p->cdev[m] = dev;
            p->chost[m] = host;
            p->csize[m] = pg->size;
            m++;
        }
    }
    Py_ssize_t dst = buf_new(b, (size_t)m * 8), src = buf_new(b, (size_t)m * 8), sz = buf_new(b, (size_t)m * 8);
    if (dst < 0 || src < 0 || sz < 0)
        return -1;
    uint64_t *d = buf_at(b, dst), *s = buf_at(b, src), *z = buf_at(b, sz);
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t host = p->chost[i] + p->host_base;
        d[i] = p->to_host ? host : p->cdev[i];
        s[i] = p->to_host ? p->cdev[i] : host;
        z[i] = p->csize[i];
    }
    /* stream_parts: as many streams as slices of MIN_SLICE_BYTES and of
     * MIN_SLICE_DESCRIPTORS allow, at most the lane's. */
    uint64_t by_bytes = total / p->min_slice_bytes, by_count = (uint64_t)m / p->min_slice_descriptors;
    uint64_t parts = (uint64_t)p->max_streams;
    if (by_bytes < parts)
        parts = by_bytes;
    if (by_count < parts)
        parts = by_count;
    if (parts < 1)
        parts = 1;
    uint64_t bounds[MAX_STREAMS + 1];
    int nparts = byte_splits(z, m, (int)parts, bounds);
    if (dep)
        row(b, OP_WAIT, p->main, dep, 0, 0, 0, 0, 0);
    row(b, OP_RECORD, start, p->main, 0, 0, 0, 0, 0);
    if (nparts <= 1 || p->nsubs == 0) {
        put(p, b, dst, 0, (uint64_t)m, p->main);
    } else {
        for (int i = 0; i < nparts; i++) {
            row(b, OP_WAIT, p->subs[i], start, 0, 0, 0, 0, 0);
            put(p, b, dst, bounds[i], bounds[i + 1], p->subs[i]);
        }
        for (int i = 0; i < nparts; i++) {
            row(b, OP_RECORD, p->joins[i], p->subs[i], 0, 0, 0, 0, 0);
            row(b, OP_WAIT, p->main, p->joins[i], 0, 0, 0, 0, 0);
        }
    }
    row(b, OP_RECORD, stop, p->main, 0, 0, 0, 0, 0);
    return b->oom ? -1 : 0;
}

/* ---------------------------------------------------------------- staged plan */

/* One launch of the piece kernel: pages [first, first + npages) of blocks ``rows[0..n)``,
 * block z's image at ``image + z * block_bytes`` (the parameters as ``PieceKernel`` packs
 * them; rows past ``n`` are zero). */
static void
launch_one(const PlannerObject *p, Builder *b, Py_ssize_t offsets, const uint32_t *rows, uint64_t n,
           uint64_t image, uint32_t to_device, uint64_t tiles, uint64_t first, uint64_t npages)
{
    Py_ssize_t blob = buf_new(b, BLOB_BYTES);
    if (blob < 0)
        return;
    unsigned char *at = buf_at(b, blob);
    memset(at, 0, BLOB_BYTES);
    uint64_t total = tiles * npages * n, step = p->block_bytes;
    uint32_t first32 = (uint32_t)first, t32 = (uint32_t)tiles, n32 = (uint32_t)npages, tot32 = (uint32_t)total;
    memcpy(at + 0, &p->page_table, 8);
    memcpy(at + 8, &image, 8);
    memcpy(at + 16, &step, 8);
    memcpy(at + 24, &first32, 4);
    memcpy(at + 28, &to_device, 4);
    memcpy(at + 32, &t32, 4);
    memcpy(at + 36, &n32, 4);
    memcpy(at + 40, &tot32, 4);
    memcpy(at + 44, rows, (size_t)n * 4);
    uint64_t ctas = p->max_ctas == 0 ? total : (total < p->max_ctas ? total : p->max_ctas);
    row(b, OP_LAUNCH, p->kstream, p->function, ctas ? ctas : 1, 256, (uint64_t)blob, (uint64_t)offsets, PARAMS);
}

/* ``PieceKernel.launch``: every page of the blocks at device ``rows``, one launch for a
 * slice of at most 256 blocks (more where tile numbers would pass 31 bits). */
static void
launch(const PlannerObject *p, Builder *b, Py_ssize_t offsets, const uint32_t *rows, uint64_t n,
       uint64_t image, uint32_t to_device)
{
    uint64_t tiles = (p->longest + TILE_BYTES - 1) / TILE_BYTES, npages = p->st_npages;
    if (tiles < 1)
        tiles = 1;
    uint64_t total = tiles * npages * n;
    if (total > 0 && total <= MAX_TILES && n <= ROWS_PER_LAUNCH) {
        launch_one(p, b, offsets, rows, n, image, to_device, tiles, 0, npages);
        return;
    }
    uint64_t block_step = MAX_TILES / tiles;
    if (block_step > ROWS_PER_LAUNCH)
        block_step = ROWS_PER_LAUNCH;
    if (block_step < 1)
        block_step = 1;
    for (uint64_t z = 0; z < n; z += block_step) {
        uint64_t nb = n - z < block_step ? n - z : block_step, page_step = MAX_TILES / (tiles * nb);
        if (page_step < 1)
            page_step = 1;
        for (uint64_t pg = 0; pg < npages; pg += page_step) {
            uint64_t np_ = npages - pg < page_step ? npages - pg : page_step;
            launch_one(p, b, offsets, rows + z, nb, image + z * p->block_bytes, to_device, tiles, pg, np_);
        }
    }
}

/* ``block_job`` and ``StagedCopy.enqueue``: the blocks in host order (``schunk``/``sgpu``,
 * sorted), cut into slices of a slot each, gathered (stores) or scattered (loads) by one
 * launch per slice between the slot and their device rows, and moved between the slot and
 * the host chunks as runs of neighbouring chunks. ``*next_slot`` and ``*first`` (no job went
 * through the ring yet) are the ring's state, updated here. */
static int
plan_staged(const PlannerObject *p, Builder *b, Py_ssize_t n, uint64_t start, uint64_t stop, uint64_t dep,
            int *next_slot, int first_job)
{
    const uint64_t bb = p->block_bytes, per = p->slot_bytes / bb;
    const int to_host = p->to_host;
    const uint64_t k = p->kstream, d = p->dstream, main = to_host ? d : k;
    uint32_t *rows = malloc((size_t)n * sizeof(uint32_t));
    uint64_t *host = malloc((size_t)n * sizeof(uint64_t));
    Py_ssize_t *run_start = malloc(((size_t)n + 1) * sizeof(Py_ssize_t));
    if (rows == NULL || host == NULL || run_start == NULL) {
        free(rows), free(host), free(run_start);
        return -1;
    }
    Py_ssize_t nruns = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        rows[i] = (uint32_t)p->sgpu[i];
        host[i] = (uint64_t)p->schunk[i] * p->chunk_bytes + p->host_base;
        if (i == 0 || host[i] != host[i - 1] + bb || (uint64_t)i % per == 0)
            run_start[nruns++] = i;
    }
    run_start[nruns] = n;
    Py_ssize_t offsets = buf_new(b, sizeof PARAM_OFFSETS);
    if (offsets < 0)
        goto oom;
    memcpy(buf_at(b, offsets), PARAM_OFFSETS, sizeof PARAM_OFFSETS);
    if (first_job) { /* the DMA stream writes the ring too: it starts behind its allocation */
        row(b, OP_RECORD, p->joined, k, 0, 0, 0, 0, 0);
        row(b, OP_WAIT, d, p->joined, 0, 0, 0, 0, 0);
    }
    uint64_t slices = ((uint64_t)n + per - 1) / per;
    int slot0 = *next_slot;
    *next_slot = (int)(((uint64_t)slot0 + slices) % 2);
    if (to_host && dep)
        row(b, OP_WAIT, d, dep, 0, 0, 0, 0, 0);
    row(b, OP_RECORD, start, d, 0, 0, 0, 0, 0);
    if (to_host && dep)
        row(b, OP_WAIT, k, dep, 0, 0, 0, 0, 0);
    Py_ssize_t r = 0; /* the first run of the slice */
    for (uint64_t s = 0; s < slices; s++) {
        int slot = (int)(((uint64_t)slot0 + s) % 2);
        uint64_t at = p->ring + (uint64_t)slot * p->slot_bytes;
        uint64_t lo = s * per, hi = lo + per < (uint64_t)n ? lo + per : (uint64_t)n;
        Py_ssize_t r_hi = r + 1; /* the slice's runs: every run up to the next slice's start */
        while (r_hi < nruns && (uint64_t)run_start[r_hi] % per != 0)
            r_hi++;
        if (to_host) {
            row(b, OP_WAIT, k, p->free_[slot], 0, 0, 0, 0, 0);
            launch(p, b, offsets, rows + lo, hi - lo, at, 0);
            row(b, OP_RECORD, p->full[slot], k, 0, 0, 0, 0, 0);
            row(b, OP_WAIT, d, p->full[slot], 0, 0, 0, 0, 0);
        } else {
            row(b, OP_WAIT, d, p->free_[slot], 0, 0, 0, 0, 0);
        }
        /* The slice's DMA runs between the slot and the host chunks (``_move``). */
        if (r_hi - r == 1) {
            uint64_t chunk = host[run_start[r]], in_slot = at + ((uint64_t)run_start[r] % per) * bb;
            uint64_t nbytes = (uint64_t)(run_start[r + 1] - run_start[r]) * bb;
            row(b, OP_COPY, d, to_host ? chunk : in_slot, to_host ? in_slot : chunk, nbytes, 0, 0, 0);
        } else {
            Py_ssize_t nr = r_hi - r;
            Py_ssize_t bd = buf_new(b, (size_t)nr * 8), bs = buf_new(b, (size_t)nr * 8), bz = buf_new(b, (size_t)nr * 8);
            if (bd < 0 || bs < 0 || bz < 0)
                goto oom;
            uint64_t *td = buf_at(b, bd), *ts = buf_at(b, bs), *tz = buf_at(b, bz);
            for (Py_ssize_t j = 0; j < nr; j++) {
                Py_ssize_t x = run_start[r + j];
                uint64_t chunk = host[x], in_slot = at + ((uint64_t)x % per) * bb;
                td[j] = to_host ? chunk : in_slot;
                ts[j] = to_host ? in_slot : chunk;
                tz[j] = (uint64_t)(run_start[r + j + 1] - x) * bb;
            }
            row(b, OP_BATCH, d, (uint64_t)bd, (uint64_t)bs, (uint64_t)bz, (uint64_t)nr, flags_of(p), 0);
            b->cost += US_PER_DESCRIPTOR * (double)nr;
        }
        if (to_host) {
            row(b, OP_RECORD, p->free_[slot], d, 0, 0, 0, 0, 0);
        } else {
            row(b, OP_RECORD, p->full[slot], d, 0, 0, 0, 0, 0);
            row(b, OP_WAIT, k, p->full[slot], 0, 0, 0, 0, 0);
            if (s == 0 && dep)
                row(b, OP_WAIT, k, dep, 0, 0, 0, 0, 0);
            launch(p, b, offsets, rows + lo, hi - lo, at, 1);
            row(b, OP_RECORD, p->free_[slot], k, 0, 0, 0, 0, 0);
        }
        r = r_hi;
    }
    row(b, OP_RECORD, stop, main, 0, 0, 0, 0, 0);
    free(rows), free(host), free(run_start);
    return b->oom ? -1 : 0;
oom:
    free(rows), free(host), free(run_start);
    return -1;
}

/* ------------------------------------------------------------------------ object */

static int
read_streams(PyObject *seq, uint64_t *out, int *n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > MAX_STREAMS) {
        Py_DECREF(fast);
        aiokv_bad_input("%s: at most %d, got %zd", what, MAX_STREAMS, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        out[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

static int
Planner_init(PlannerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "issuer", "pages", "chunk_bytes", "host_base", "num_chunks", "num_blocks", "to_host", "main", "rescue",
        "subs", "joins", "max_streams", "min_slice_bytes", "min_slice_descriptors", "run_here_us",
        "staged", "kernel_stream", "dma_stream", "full", "free", "joined", "function", "longest",
        "slot_bytes", "gains_only", "has_shape", "min_staged_pieces", "direct_piece_bytes", "max_ctas", NULL};
    PyObject *issuer, *pages, *subs, *joins, *full = NULL, *free_ = NULL;
    unsigned long long chunk_bytes, host_base, num_chunks, num_blocks, main_stream, rescue, min_bytes, min_desc;
    unsigned long long kstream = 0, dstream = 0, joined = 0, function = 0, longest = 0, slot_bytes = 0;
    unsigned long long min_pieces = 64, direct = 1 << 20, max_ctas = 0;
    int to_host, max_streams, staged = 0, gains_only = 1, has_shape = 0;
    double run_here_us;
    if (self->issuer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Planner is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKKKKpKKOOiKKd|pKKOOKKKKppKKK", kwlist, &issuer, &pages,
                                     &chunk_bytes, &host_base, &num_chunks, &num_blocks, &to_host, &main_stream,
                                     &rescue, &subs, &joins, &max_streams, &min_bytes, &min_desc, &run_here_us,
                                     &staged, &kstream, &dstream, &full, &free_, &joined, &function, &longest,
                                     &slot_bytes, &gains_only, &has_shape, &min_pieces, &direct, &max_ctas))
        return -1;
    if (aiokv_issuer_state(issuer) == NULL)
        return -1;
    if (chunk_bytes == 0 || num_chunks == 0 || num_blocks == 0 || rescue == 0 || max_streams < 1 ||
        max_streams > MAX_STREAMS || min_bytes == 0 || min_desc == 0)
        return aiokv_bad_input("a planner needs chunks, blocks, a rescue event, 1-%d streams and slice sizes",
                               MAX_STREAMS), -1;
    Py_buffer v;
    if (aiokv_get_view(pages, &v, "pages", -1) < 0)
        return -1;
    if (!aiokv_is_words(&v) || v.len == 0 || v.len % (5 * 8) != 0) {
        PyBuffer_Release(&v);
        return aiokv_bad_input("pages must be rows of 5 8-byte integers (tensor, base, stride, bytes, offset)"), -1;
    }
    self->npages = v.len / (5 * 8);
    free(self->pages); /* left by an __init__ that raised part way, if any */
    self->pages = malloc(v.len);
    if (self->pages == NULL) {
        PyBuffer_Release(&v);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->pages, v.buf, v.len);
    PyBuffer_Release(&v);
    self->block_bytes = 0;
    for (Py_ssize_t i = 0; i < self->npages; i++)
        self->block_bytes += self->pages[i].size;
    int njoins = 0;
    if (read_streams(subs, self->subs, &self->nsubs, "subs") < 0 ||
        read_streams(joins, self->joins, &njoins, "joins") < 0)
        return -1;
    if (njoins != self->nsubs)
        return aiokv_bad_input("a join event per DMA stream"), -1;
    if (staged) {
        int n = 0;
        if (full == NULL || free_ == NULL || read_streams(full, self->full, &n, "full") < 0)
            return full == NULL || free_ == NULL ? (aiokv_bad_input("staged: full and free events"), -1) : -1;
        if (n != 2 || read_streams(free_, self->free_, &n, "free") < 0 || n != 2)
            return PyErr_Occurred() ? -1 : (aiokv_bad_input("staged: two full and two free events"), -1);
    }
    free(self->seen);
    self->seen = calloc(num_blocks, sizeof(uint32_t));
    if (self->seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->chunk_bytes = chunk_bytes, self->host_base = host_base, self->num_chunks = num_chunks;
    self->num_blocks = num_blocks, self->to_host = to_host, self->main = main_stream, self->rescue = rescue;
    self->max_streams = max_streams, self->min_slice_bytes = min_bytes, self->min_slice_descriptors = min_desc;
    self->run_here_us = run_here_us, self->staged = staged, self->kstream = kstream, self->dstream = dstream;
    self->joined = joined, self->function = function, self->longest = longest, self->slot_bytes = slot_bytes;
    self->gains_only = gains_only, self->has_shape = has_shape, self->st_npages = (uint64_t)self->npages;
    self->min_staged_pieces = min_pieces, self->direct_piece_bytes = direct, self->max_ctas = max_ctas;
    /* Last: an issuer says the planner is whole (``submit`` refuses one without). */
    self->issuer = issuer;
    Py_INCREF(issuer);
    return 0;
}

/* The job's ids in the planner's scratch; 1: not a job planned here. */
static int
take_ids(PlannerObject *self, PyObject *blocks, PyObject *chunks, Py_ssize_t *n)
{
    Py_ssize_t nb = 0, nc = 0;
    int r = read_ids(blocks, &self->gpu, &self->gcap, &nb);
    if (r == 0)
        r = read_ids(chunks, &self->chunk, &self->kcap, &nc);
    if (r != 0)
        return r;
    if (nb != nc || nb == 0)
        return 1;
    if ((size_t)nb > self->scap) {
        int64_t *g = realloc(self->sgpu, (size_t)nb * sizeof(int64_t));
        if (g != NULL)
            self->sgpu = g;
        int64_t *c = g == NULL ? NULL : realloc(self->schunk, (size_t)nb * sizeof(int64_t));
        if (c != NULL)
            self->schunk = c;
        int64_t *t = c == NULL ? NULL : realloc(self->tmp, 2 * (size_t)nb * sizeof(int64_t));
        if (t == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->tmp = t;
        self->scap = (size_t)nb;
    }
    *n = nb;
    return 0;
}

/* ``map_blocks``' checks of one group of one block per chunk: ids in range, and no
 * destination written twice. 1 where any fails: the Python plan raises its error. */
static int
check_ids(PlannerObject *self, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (self->gpu[i] < 0 || (uint64_t)self->gpu[i] >= self->num_blocks || self->chunk[i] < 0 ||
            (uint64_t)self->chunk[i] >= self->num_chunks)
            return 1;
    memcpy(self->sgpu, self->gpu, (size_t)n * sizeof(int64_t));
    memcpy(self->schunk, self->chunk, (size_t)n * sizeof(int64_t));
    sort_pairs(self->schunk, self->sgpu, self->tmp, n);
    if (self->to_host) { /* a store writes each chunk once */
        for (Py_ssize_t i = 1; i < n; i++)
            if (self->schunk[i] == self->schunk[i - 1])
                return 1;
    } else { /* a load writes each GPU block once */
        if (++self->stamp == 0) {
            memset(self->seen, 0, self->num_blocks * sizeof(uint32_t));
            self->stamp = 1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (self->seen[self->gpu[i]] == self->stamp)
                return 1;
            self->seen[self->gpu[i]] = self->stamp;
        }
    }
    return 0;
}

PyDoc_STRVAR(plan_submit_doc,
"submit(block_ids, chunk_ids, start, stop, dep_event=0, dep_stream=0, dep_source=0, record_dep=False)\n"
"-> Ticket | None | (cuda_result, opcode)\n\n"
"Check the job's ids, build its whole program in C and queue it on the issuer (a tiny one\n"
"runs at once on an idle issuer): its Ticket. None where the job is not one planned here,\n"
"bad input among them: nothing was done, and the lane plans it in Python. Before queueing,\n"
"on this thread: with ``record_dep``, ``dep_event`` is recorded on ``dep_stream`` (0 is the\n"
"legacy default stream, a real one) behind a wait on\n"
"``dep_source``, if given); if that fails, (its CUresult, the call's opcode) and nothing is\n"
"queued.");

static PyObject *
Planner_submit(PlannerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"block_ids", "chunk_ids", "start", "stop", "dep_event", "dep_stream", "dep_source",
                             "record_dep", NULL};
    PyObject *blocks, *chunks;
    unsigned long long start, stop, dep = 0, dep_stream = 0, dep_source = 0;
    int record_dep = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKK|KKKp", kwlist, &blocks, &chunks, &start, &stop, &dep,
                                     &dep_stream, &dep_source, &record_dep))
        return NULL;
    if (self->issuer == NULL)
        return PyErr_Format(PyExc_RuntimeError, "this Planner was never initialised (its __init__ did not "
                            "complete)");
    IssuerState *st = aiokv_issuer_state(self->issuer);
    if (st == NULL)
        return NULL;
    if (start == 0 || stop == 0)
        return aiokv_bad_input("a job's start and stop events must not be null");
    Py_ssize_t n = 0;
    int r = take_ids(self, blocks, chunks, &n);
    if (r < 0)
        return NULL;
    if (r > 0 || check_ids(self, n))
        Py_RETURN_NONE;
    uint64_t pieces = (uint64_t)n * (uint64_t)self->npages, total = (uint64_t)n * self->block_bytes;
    int gains = pieces >= self->min_staged_pieces && total < self->direct_piece_bytes * pieces;
    int staged = 0;
    if (self->staged && pieces && (gains || !self->gains_only) && self->slot_bytes > 0) {
        if (!self->has_shape || self->block_bytes > self->slot_bytes || self->ring == 0)
            Py_RETURN_NONE; /* a piece job, or the ring is not there yet: the Python plan */
        staged = 1;
    }
    Builder *b = &self->b;
    b->nrows = b->nbuf = 0, b->used = 0, b->cost = 0, b->oom = 0;
    int next_slot = self->next_slot;
    if ((staged ? plan_staged(self, b, n, start, stop, dep, &next_slot, self->staged_jobs == 0)
                : plan_dma(self, b, n, start, stop, dep)) < 0 || b->oom)
        return PyErr_NoMemory();
    /* The dependency, on the caller's stream as it stands now. Stream 0 is the legacy
     * default stream (torch's default), a stream like any other: a flag says whether to
     * record, never the handle's value. */
    if (record_dep && dep != 0) {
        const DriverTable *d = aiokv_issuer_table(st);
        CUresult code = 0;
        int op = OP_WAIT;
        atomic_fetch_add_explicit(&aiokv_caller_calls, 1, memory_order_acq_rel); /* issuers: give way */
        if (dep_source != 0)
            code = ((wait_fn)d->procs[P_WAIT])((CUstream)(uintptr_t)dep_stream, (CUevent)(uintptr_t)dep_source, 0);
        if (code == 0) {
            op = OP_RECORD;
            code = ((record_fn)d->procs[P_RECORD])((CUevent)(uintptr_t)dep, (CUstream)(uintptr_t)dep_stream);
        }
        atomic_fetch_sub_explicit(&aiokv_caller_calls, 1, memory_order_acq_rel);
        if (code != 0)
            return Py_BuildValue("(ii)", code, op);
    }
    Program *p = aiokv_program_new(st, b->nrows, b->nbuf, b->used);
    if (p == NULL)
        return PyErr_NoMemory();
    memcpy(p->rows, b->rows, (size_t)b->nrows * WORDS * 8);
    for (Py_ssize_t i = 0; i < b->nbuf; i++)
        memcpy(aiokv_program_alloc(p, i, b->bufs[i].len), b->data + b->bufs[i].off, b->bufs[i].len);
    p->main = self->main;
    p->rescue = self->rescue;
    p->end = stop;
    PyObject *ticket = aiokv_issuer_queue(st, p, b->cost <= self->run_here_us);
    if (ticket != NULL && staged) {
        self->next_slot = next_slot;
        self->staged_jobs++;
    }
    self->last_staged = ticket != NULL && staged;
    return ticket;
}

PyDoc_STRVAR(set_staging_doc,
"set_staging(ring, slot_bytes, page_table)\n\nThe staging ring's device address, its slot size\n"
"and the layout's page table on the device, once the lane has them (slot_bytes 0: the ring\n"
"could not be had; staged jobs then go as DMA, as in Python).");

static PyObject *
Planner_set_staging(PlannerObject *self, PyObject *args)
{
    unsigned long long ring, slot_bytes, table;
    if (!PyArg_ParseTuple(args, "KKK", &ring, &slot_bytes, &table))
        return NULL;
    if (slot_bytes != 0 && (ring == 0 || table == 0))
        return aiokv_bad_input("a staging ring needs its address and the page table's");
    self->ring = ring, self->slot_bytes = slot_bytes, self->page_table = table;
    Py_RETURN_NONE;
}

static PyObject *
Planner_get_next_slot(PlannerObject *self, void *unused)
{
    return PyLong_FromLong(self->next_slot);
}

static int
Planner_set_next_slot(PlannerObject *self, PyObject *value, void *unused)
{
    long v = value == NULL ? -1 : PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > 1) {
        aiokv_bad_input("next_slot is 0 or 1");
        return -1;
    }
    self->next_slot = (int)v;
    return 0;
}

static PyObject *
Planner_get_staged_jobs(PlannerObject *self, void *unused)
{
    return PyLong_FromLongLong(self->staged_jobs);
}

static int
Planner_set_staged_jobs(PlannerObject *self, PyObject *value, void *unused)
{
    long long v = value == NULL ? -1 : PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        aiokv_bad_input("staged_jobs is a count");
        return -1;
    }
    self->staged_jobs = v;
    return 0;
}

static PyObject *
Planner_get_last_staged(PlannerObject *self, void *unused)
{
    return PyBool_FromLong(self->last_staged);
}

static void
Planner_dealloc(PlannerObject *self)
{
    Py_CLEAR(self->issuer);
    void *owned[] = {self->pages, self->gpu, self->chunk, self->sgpu, self->schunk, self->tmp, self->cdev,
                     self->chost, self->csize, self->ctensor, self->seen, self->b.rows, self->b.bufs, self->b.data};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++)
        free(owned[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Planner_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Planner_submit, METH_VARARGS | METH_KEYWORDS, plan_submit_doc},
    {"set_staging", (PyCFunction)Planner_set_staging, METH_VARARGS, set_staging_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Planner_getset[] = {
    {"next_slot", (getter)Planner_get_next_slot, (setter)Planner_set_next_slot,
     "the staging slot the next staged job starts in (shared with the Python plan)", NULL},
    {"staged_jobs", (getter)Planner_get_staged_jobs, (setter)Planner_set_staged_jobs,
     "jobs that went through the ring so far (shared with the Python plan)", NULL},
    {"last_staged", (getter)Planner_get_last_staged, NULL, "whether the last job planned here went staged",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Planner_doc,
"Planner(issuer, pages, chunk_bytes, host_base, num_chunks, num_blocks, to_host, main, rescue,\n"
"        subs, joins, max_streams, min_slice_bytes, min_slice_descriptors, run_here_us,\n"
"        staged=False, kernel_stream=0, dma_stream=0, full=None, free=None, joined=0,\n"
"        function=0, longest=0, slot_bytes=0, gains_only=True, has_shape=False,\n"
"        min_staged_pieces=64, direct_piece_bytes=1 MiB, max_ctas=0)\n\n"
"One lane's planner (see ``submit``): ``pages`` holds a row per page of a block in the\n"
"layout's order (tensor index, the tensor's device base, row stride, bytes, offset in the\n"
"chunk); the rest is the lane's streams, events and the thresholds of its strategy.");

PyTypeObject aiokv_PlannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Planner",
    .tp_basicsize = sizeof(PlannerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Planner_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Planner_init,
    .tp_dealloc = (destructor)Planner_dealloc,
    .tp_methods = Planner_methods,
    .tp_getset = Planner_getset,
};
