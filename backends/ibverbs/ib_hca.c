/* SPDX-License-Identifier: Apache-2.0
 *
 * ib_hca.c - $XCCL_IB_HCA parsing and matching (ib_hca.h).
 */
#include "ib_hca.h"

#include <stdio.h>
#include <string.h>

static int name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-' || c == '.';
}

static int blank(char c)
{
    return c == ' ' || c == '\t';
}

/* One entry: [b, e) with the blanks around it already trimmed. */
static int parse_entry(const char *b, const char *e, xccl_ib_hca_ent_t *ent, char *err,
                       size_t errlen)
{
    const char *colon = memchr(b, ':', (size_t)(e - b));
    const char *ne    = colon != NULL ? colon : e;
    size_t      nl    = (size_t)(ne - b);

    if (nl == 0) {
        snprintf(err, errlen, "entry '%.*s' has no device name", (int)(e - b), b);
        return -1;
    }
    if (nl >= XCCL_IB_HCA_NAME) {
        snprintf(err, errlen, "device name '%.*s' is longer than %d characters", (int)nl, b,
                 XCCL_IB_HCA_NAME - 1);
        return -1;
    }
    for (const char *c = b; c < ne; c++) {
        if (!name_char(*c)) {
            snprintf(err, errlen, "entry '%.*s': '%c' is not allowed in a device name",
                     (int)(e - b), b, *c);
            return -1;
        }
    }
    memcpy(ent->name, b, nl);
    ent->name[nl] = '\0';
    ent->port     = 0;
    if (colon != NULL) {
        int port = 0;
        if (colon + 1 == e) {
            snprintf(err, errlen, "entry '%.*s': no port number after ':'", (int)(e - b), b);
            return -1;
        }
        for (const char *c = colon + 1; c < e; c++) {
            if (*c < '0' || *c > '9' || port > 255) {
                port = -1;
                break;
            }
            port = port * 10 + (*c - '0');
        }
        if (port < 1 || port > 255) {
            snprintf(err, errlen, "entry '%.*s': the port must be a number from 1 to 255",
                     (int)(e - b), b);
            return -1;
        }
        ent->port = port;
    }
    return 0;
}

int xccl_ib_hca_parse(const char *spec, xccl_ib_hca_t *out, char *err, size_t errlen)
{
    const char *s = spec != NULL ? spec : "";

    memset(out, 0, sizeof(*out));
    if (errlen > 0) err[0] = '\0';
    while (blank(*s))
        s++;
    if (*s == '\0') return 0;
    for (int i = 0; i < 2; i++) { /* "^=", "=^", "^" or "=" */
        if (*s == '^' && !out->exclude)
            out->exclude = 1, s++;
        else if (*s == '=' && !out->exact)
            out->exact = 1, s++;
    }
    for (;;) {
        const char *b = s, *e = strchr(s, ',');
        if (e == NULL) e = s + strlen(s);
        s = *e == ',' ? e + 1 : e;
        while (b < e && blank(*b))
            b++;
        while (e > b && blank(e[-1]))
            e--;
        if (b == e) {
            snprintf(err, errlen, "empty entry in '%s'", spec);
            return -1;
        }
        if (out->n == XCCL_IB_HCA_MAX) {
            snprintf(err, errlen, "more than %d entries", XCCL_IB_HCA_MAX);
            return -1;
        }
        if (parse_entry(b, e, &out->ent[out->n], err, errlen) != 0) return -1;
        out->n++;
        if (*s == '\0' && s[-1] != ',') break;
        if (*s == '\0') { /* a trailing ',' */
            snprintf(err, errlen, "empty entry in '%s'", spec);
            return -1;
        }
    }
    return 0;
}

int xccl_ib_hca_match(const xccl_ib_hca_t *h, const char *dev, int port)
{
    int found = 0;

    if (h->n == 0) return 1;
    for (int i = 0; i < h->n && !found; i++) {
        const xccl_ib_hca_ent_t *e = &h->ent[i];
        int                      name_ok =
            h->exact ? strcmp(dev, e->name) == 0 : strncmp(dev, e->name, strlen(e->name)) == 0;
        found = name_ok && (e->port == 0 || e->port == port);
    }
    return h->exclude ? !found : found;
}
