/* SPDX-License-Identifier: Apache-2.0
 *
 * test_ibhca.c - $XCCL_IB_HCA parsing and matching (backends/ibverbs/ib_hca.c), NCCL's syntax:
 * prefix match by default, '=' exact, '^' exclude, ':port'. Needs no RDMA device.
 */
#include <string.h>

#include "../../backends/ibverbs/ib_hca.h"
#include "ctest.h"

static int parses(const char *spec, xccl_ib_hca_t *h)
{
    char err[256];
    int  rc = xccl_ib_hca_parse(spec, h, err, sizeof(err));
    CHECK_MSG(rc == 0, "'%s' refused: %s", spec, err);
    return rc == 0;
}

static void refused(const char *spec, const char *want)
{
    xccl_ib_hca_t h;
    char          err[256];
    int           rc = xccl_ib_hca_parse(spec, &h, err, sizeof(err));
    CHECK_MSG(rc == -1, "'%s' accepted", spec);
    CHECK_MSG(rc != -1 || strstr(err, want) != NULL, "'%s': message '%s' lacks '%s'", spec, err,
              want);
}

int main(void)
{
    xccl_ib_hca_t h;

    /* empty: everything */
    if (parses(NULL, &h)) CHECK(h.n == 0 && xccl_ib_hca_match(&h, "rxe0", 1));
    if (parses("", &h)) CHECK(h.n == 0 && xccl_ib_hca_match(&h, "mlx5_3", 2));
    if (parses("  ", &h)) CHECK(h.n == 0 && !h.exclude && !h.exact);

    /* prefix match, ports */
    if (parses("mlx5_0:1,mlx5_1", &h)) {
        CHECK(h.n == 2 && !h.exclude && !h.exact);
        CHECK(strcmp(h.ent[0].name, "mlx5_0") == 0 && h.ent[0].port == 1);
        CHECK(strcmp(h.ent[1].name, "mlx5_1") == 0 && h.ent[1].port == 0);
        CHECK(xccl_ib_hca_match(&h, "mlx5_0", 1));
        CHECK(!xccl_ib_hca_match(&h, "mlx5_0", 2));
        CHECK(xccl_ib_hca_match(&h, "mlx5_1", 1) && xccl_ib_hca_match(&h, "mlx5_1", 2));
        CHECK(xccl_ib_hca_match(&h, "mlx5_10", 7)); /* prefix of "mlx5_10" */
        CHECK(!xccl_ib_hca_match(&h, "mlx5_2", 1));
        CHECK(!xccl_ib_hca_match(&h, "rxe0", 1));
    }
    if (parses(" mlx5 , rxe0:2 ", &h)) {
        CHECK(h.n == 2 && strcmp(h.ent[0].name, "mlx5") == 0 && h.ent[1].port == 2);
        CHECK(xccl_ib_hca_match(&h, "mlx5_4", 1) && !xccl_ib_hca_match(&h, "rxe0", 1));
        CHECK(xccl_ib_hca_match(&h, "rxe0", 2));
    }

    /* exact */
    if (parses("=mlx5_1", &h)) {
        CHECK(h.exact && !h.exclude && h.n == 1);
        CHECK(xccl_ib_hca_match(&h, "mlx5_1", 1));
        CHECK(!xccl_ib_hca_match(&h, "mlx5_10", 1));
        CHECK(!xccl_ib_hca_match(&h, "mlx5_", 1));
    }

    /* exclude, with and without exact, in either prefix order */
    if (parses("^mlx5_2", &h)) {
        CHECK(h.exclude && !h.exact);
        CHECK(!xccl_ib_hca_match(&h, "mlx5_2", 1) && !xccl_ib_hca_match(&h, "mlx5_20", 1));
        CHECK(xccl_ib_hca_match(&h, "mlx5_1", 1) && xccl_ib_hca_match(&h, "rxe0", 1));
    }
    if (parses("^=mlx5_2:1", &h)) {
        CHECK(h.exclude && h.exact);
        CHECK(!xccl_ib_hca_match(&h, "mlx5_2", 1));
        CHECK(xccl_ib_hca_match(&h, "mlx5_2", 2));
        CHECK(xccl_ib_hca_match(&h, "mlx5_20", 1));
    }
    if (parses("=^rxe0", &h)) CHECK(h.exclude && h.exact && !xccl_ib_hca_match(&h, "rxe0", 1));
    if (parses("rxe0:255", &h)) CHECK(h.ent[0].port == 255);

    /* syntax errors name what is wrong */
    refused(",", "empty entry");
    refused("mlx5_0,", "empty entry");
    refused("mlx5_0,,mlx5_1", "empty entry");
    refused("^", "empty entry");
    refused("mlx5_0:", "no port");
    refused("mlx5_0:0", "port must be");
    refused("mlx5_0:256", "port must be");
    refused("mlx5_0:1x", "port must be");
    refused("mlx5_0:99999999999", "port must be");
    refused(":1", "no device name");
    refused("mlx5/0", "not allowed");
    refused("^^mlx5_0", "not allowed");
    refused("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "longer than");
    {
        char many[512] = "";
        for (int i = 0; i < XCCL_IB_HCA_MAX + 1; i++)
            strcat(many, i ? ",d" : "d");
        refused(many, "more than");
    }
    CTEST_MAIN_END("test_ibhca");
}
