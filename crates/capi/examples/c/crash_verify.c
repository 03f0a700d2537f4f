/*
 * crash_verify: acknowledged writes survive a crash of the process that made them.
 *
 *   crash_verify write  CACHE BACKING BLOCKS SEED > ACKS
 *       Opens the cache CACHE (created, 64 MiB) in front of BACKING (created, 256 MiB, if
 *       missing), writes BLOCKS blocks, each holding its block number and SEED, prints
 *       "acked N" for each write pmcache acknowledged, then kills itself with SIGKILL: no
 *       handle or cache is closed.
 *
 *   crash_verify verify CACHE BACKING SEED ACKS
 *       Opens the same cache again (pmcache recovers it from the medium), checks that every
 *       block ACKS names reads back as written, closes the cache cleanly and, on a volatile
 *       medium, whose close writes every block back, checks them on BACKING itself. Exits 0
 *       if every block is there, 1 if not.
 *
 * The medium must outlive the process: a file in /dev/shm does (docs/DURABILITY.md). Build
 * and run it as docs/EMBEDDING.md says; crates/capi/tests/c_example.rs runs it.
 */
#define _POSIX_C_SOURCE 200809L

#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pmcache.h"

/* Fills `block` (`bytes` long) as block `number` is written with `seed`: the number, the
 * seed, then words that mix both. */
static void fill(uint64_t *block, uint32_t bytes, uint64_t number, uint64_t seed)
{
    block[0] = number;
    block[1] = seed;
    for (uint32_t i = 2; i < bytes / 8; i++)
        block[i] = (number * UINT64_C(0x9e3779b97f4a7c15)) ^ seed ^ i;
}

static struct pmcache *open_cache(const char *cache_path, const char *backing_path)
{
    struct pmcache_config config = {
        .size = sizeof(struct pmcache_config),
        .cache_path = cache_path,
        .cache_bytes = 64u << 20,
        .backing_path = backing_path,
        .backing_bytes = 256u << 20,
        .mode = PMCACHE_MODE_WRITE_BACK,
        .lanes = 1,
    };
    char err[1024];
    struct pmcache *cache = pmcache_open(&config, err, sizeof err);
    if (!cache)
        fprintf(stderr, "crash_verify: %s\n", err);
    return cache;
}

static int write_and_crash(const char *cache_path, const char *backing_path, uint64_t blocks,
                           uint64_t seed)
{
    struct pmcache *cache = open_cache(cache_path, backing_path);
    if (!cache)
        return 2;
    char err[1024];
    struct pmcache_handle *handle = pmcache_handle_open(cache, err, sizeof err);
    if (!handle) {
        fprintf(stderr, "crash_verify: %s\n", err);
        return 2;
    }
    uint32_t bytes = pmcache_block_bytes(cache);
    if (blocks > pmcache_size_bytes(cache) / bytes) {
        fprintf(stderr, "crash_verify: %" PRIu64 " blocks do not fit the device\n", blocks);
        return 2;
    }
    uint64_t *block = malloc(bytes);
    if (!block)
        return 2;
    for (uint64_t number = 0; number < blocks; number++) {
        fill(block, bytes, number, seed);
        /* Every eighth write with PMCACHE_FUA: in write-back every acknowledged write is
         * durable on the medium anyway. */
        uint32_t flags = number % 8 == 7 ? PMCACHE_FUA : 0;
        int rc = pmcache_write(handle, number * bytes, block, bytes, flags);
        if (rc != 0) {
            fprintf(stderr, "crash_verify: write of block %" PRIu64 ": %s\n", number,
                    pmcache_last_error());
            return 2;
        }
        printf("acked %" PRIu64 "\n", number);
        fflush(stdout);
    }
    /* A crash: nothing closed, nothing written back, no clean mark. */
    kill(getpid(), SIGKILL);
    return 2;
}

/* Checks the blocks `acks` names, read by `read_block`; returns how many differ. */
static uint64_t check(FILE *acks, uint64_t seed, uint32_t bytes, uint64_t *checked,
                      int (*read_block)(void *source, uint64_t number, void *block),
                      void *source, const char *where)
{
    uint64_t *expected = malloc(bytes), *found = malloc(bytes), bad = 0;
    char line[128];
    *checked = 0;
    rewind(acks);
    while (expected && found && fgets(line, sizeof line, acks)) {
        uint64_t number;
        if (sscanf(line, "acked %" SCNu64, &number) != 1)
            continue;
        fill(expected, bytes, number, seed);
        if (read_block(source, number, found) != 0) {
            fprintf(stderr, "crash_verify: reading block %" PRIu64 " %s failed\n", number,
                    where);
            bad++;
        } else if (memcmp(expected, found, bytes) != 0) {
            fprintf(stderr,
                    "crash_verify: block %" PRIu64 " %s differs: it holds block %" PRIu64
                    " of seed %" PRIu64 "\n",
                    number, where, found[0], found[1]);
            bad++;
        }
        (*checked)++;
    }
    free(expected);
    free(found);
    return bad;
}

static uint32_t block_bytes;

static int read_cached(void *handle, uint64_t number, void *block)
{
    int rc = pmcache_read(handle, number * block_bytes, block, block_bytes);
    if (rc != 0)
        fprintf(stderr, "crash_verify: %s\n", pmcache_last_error());
    return rc;
}

static int read_backing(void *fd, uint64_t number, void *block)
{
    ssize_t n = pread(*(int *)fd, block, block_bytes, (off_t)(number * block_bytes));
    return n == (ssize_t)block_bytes ? 0 : -1;
}

static int verify(const char *cache_path, const char *backing_path, uint64_t seed,
                  const char *acks_path)
{
    FILE *acks = fopen(acks_path, "r");
    if (!acks) {
        perror(acks_path);
        return 2;
    }
    struct pmcache *cache = open_cache(cache_path, backing_path);
    if (!cache)
        return 2;
    char err[1024];
    struct pmcache_handle *handle = pmcache_handle_open(cache, err, sizeof err);
    if (!handle) {
        fprintf(stderr, "crash_verify: %s\n", err);
        return 2;
    }
    block_bytes = pmcache_block_bytes(cache);
    /* The counters `pmcache stats` shows, as JSON: the medium's kind, and the blocks that
     * recovery found dirty (acknowledged, not written back before the crash). */
    char *stats = pmcache_stats_json(cache);
    const char *dirty_at = stats ? strstr(stats, "\"dirty_slots\":") : NULL;
    uint64_t dirty = 0;
    if (dirty_at)
        sscanf(dirty_at + strlen("\"dirty_slots\":"), "%" SCNu64, &dirty);
    int volatile_medium = stats && strstr(stats, "\"medium\":\"volatile\"") != NULL;
    printf("reopened %s (%s medium): %" PRIu64 " dirty blocks recovered\n", cache_path,
           volatile_medium ? "volatile" : "persistent", dirty);
    pmcache_string_free(stats);
    uint64_t checked;
    uint64_t bad = check(acks, seed, block_bytes, &checked, read_cached, handle, "in the cache");
    printf("verified %" PRIu64 " of %" PRIu64 " acknowledged blocks in the cache\n",
           checked - bad, checked);

    pmcache_handle_close(handle);
    /* A volatile medium (tmpfs) is written back to the backing store by the close. */
    if (pmcache_close(cache) != 0) {
        fprintf(stderr, "crash_verify: close: %s\n", pmcache_last_error());
        return 1;
    }
    printf("closed cleanly\n");
    if (volatile_medium) {
        int fd = open(backing_path, O_RDONLY);
        if (fd < 0) {
            perror(backing_path);
            return 2;
        }
        uint64_t on_backing;
        uint64_t bad_backing = check(acks, seed, block_bytes, &on_backing, read_backing, &fd,
                                     "on the backing store");
        close(fd);
        printf("written back: %" PRIu64 " of %" PRIu64 " acknowledged blocks on %s\n",
               on_backing - bad_backing, on_backing, backing_path);
        bad += bad_backing;
    }
    fclose(acks);
    return bad == 0 ? 0 : 1;
}

static int usage(void)
{
    fprintf(stderr, "usage: crash_verify write CACHE BACKING BLOCKS SEED > ACKS\n"
                    "       crash_verify verify CACHE BACKING SEED ACKS\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc == 6 && strcmp(argv[1], "write") == 0)
        return write_and_crash(argv[2], argv[3], strtoull(argv[4], NULL, 0),
                               strtoull(argv[5], NULL, 0));
    if (argc == 6 && strcmp(argv[1], "verify") == 0)
        return verify(argv[2], argv[3], strtoull(argv[4], NULL, 0), argv[5]);
    return usage();
}
