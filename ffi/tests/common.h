/* Shared helpers of the C tests of libkvroute (the programs in ffi/tests). Each test is one program that
 * exits 0 when every check passed; a failed check prints its location, the expression and the
 * library's last error, and the program exits 1 at the end. */
#ifndef KVROUTE_TEST_COMMON_H
#define KVROUTE_TEST_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvroute.h"

static int g_failures = 0;
static int g_checks = 0;

static inline const char *last_error(void) {
    static _Thread_local char buf[1024];
    if (kvroute_last_error_message(buf, sizeof buf, NULL) != KVROUTE_RESULT_OK) {
        snprintf(buf, sizeof buf, "(no last error)");
    }
    return buf;
}

static inline const char *code_name(kvroute_result r) {
    const char *n = kvroute_result_name(r);
    return n ? n : "(unknown code)";
}

#define CHECK(cond)                                                                  \
    do {                                                                             \
        g_checks++;                                                                  \
        if (!(cond)) {                                                               \
            g_failures++;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                            \
    } while (0)

/* The call returns `expected`; on a mismatch, print both codes and the last error. */
#define CHECK_CODE(call, expected)                                                                    \
    do {                                                                                              \
        g_checks++;                                                                                   \
        kvroute_result r_ = (call);                                                                   \
        if (r_ != (expected)) {                                                                       \
            g_failures++;                                                                             \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", __FILE__,         \
                    __LINE__, #call, code_name(r_), code_name(expected), last_error());               \
        }                                                                                             \
    } while (0)

#define CHECK_OK(call) CHECK_CODE(call, KVROUTE_RESULT_OK)

#define CHECK_STR(actual, expected)                                                                   \
    do {                                                                                              \
        g_checks++;                                                                                   \
        const char *a_ = (actual), *e_ = (expected);                                                  \
        if (a_ == NULL || e_ == NULL || strcmp(a_, e_) != 0) {                                        \
            g_failures++;                                                                             \
            fprintf(stderr, "%s:%d: %s is \"%s\", expected \"%s\"\n", __FILE__, __LINE__, #actual,    \
                    a_ ? a_ : "(null)", e_ ? e_ : "(null)");                                          \
        }                                                                                             \
    } while (0)

/* Print the summary line and return the exit status. */
static inline int finish(const char *name) {
    printf("%s: %d checks, %d passed, %d failed\n", name, g_checks, g_checks - g_failures, g_failures);
    return g_failures == 0 ? 0 : 1;
}

/* A string accessor's whole value, in a buffer from malloc (size query, then copy). */
typedef kvroute_result (*string_getter)(const kvroute_decision *, char *, size_t, size_t *);

static inline char *dup_string(string_getter get, const kvroute_decision *d) {
    size_t need = 0;
    if (get(d, NULL, 0, &need) != KVROUTE_RESULT_BUFFER_TOO_SMALL) return NULL;
    char *s = malloc(need);
    if (s == NULL) return NULL;
    if (get(d, s, need, NULL) != KVROUTE_RESULT_OK) {
        free(s);
        return NULL;
    }
    return s;
}

/* The same for router texts (which can grow between the size query and the copy: retry). */
typedef kvroute_result (*router_text_getter)(const kvroute_router *, char *, size_t, size_t *);

static inline char *dup_router_text(router_text_getter get, const kvroute_router *r) {
    size_t need = 0;
    if (get(r, NULL, 0, &need) != KVROUTE_RESULT_BUFFER_TOO_SMALL) return NULL;
    for (;;) {
        char *s = malloc(need);
        if (s == NULL) return NULL;
        kvroute_result res = get(r, s, need, &need);
        if (res == KVROUTE_RESULT_OK) return s;
        free(s);
        if (res != KVROUTE_RESULT_BUFFER_TOO_SMALL) return NULL;
    }
}

/* Read a whole file (NUL-terminated; its length in *len). */
static inline char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return NULL;
    }
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return NULL;
    }
    char *buf = malloc((size_t)n + 1);
    if (buf != NULL && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf != NULL) {
        buf[n] = '\0';
        if (len) *len = (size_t)n;
    }
    return buf;
}

/* Hex text to bytes (malloc'd; *len bytes). */
static inline unsigned char *hex_decode(const char *hex, size_t *len) {
    size_t n = strlen(hex) / 2;
    unsigned char *out = malloc(n ? n : 1);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned int v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) {
            free(out);
            return NULL;
        }
        out[i] = (unsigned char)v;
    }
    *len = n;
    return out;
}

#endif
