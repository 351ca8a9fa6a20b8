// Checks of the C++ wrapper tests: tests/c/test_ranks.h's counters, CHECK and forked ranks, plus
// checks that a wrapper call throws epcomm::Error with an exact status and message, or does
// not throw at all.
#ifndef EPCOMM_CPP_CHECKS_HPP
#define EPCOMM_CPP_CHECKS_HPP

#include "../c/test_ranks.h"  // first: it selects POSIX for the system headers

#include <string>

#include "epcomm.hpp"

// `expr` throws epcomm::Error with status `status` and exactly the message `message`.
#define CHECK_THROWS(expr, status, message) \
    check_throws([&] { (void)(expr); }, (status), (message), __FILE__, __LINE__, #expr)

// `stmt` throws nothing (an epcomm::Error is printed with its status and message).
#define CHECK_NOTHROW(stmt) check_nothrow([&] { stmt; }, __FILE__, __LINE__, #stmt)

template <class F>
static void check_throws(F &&f, int32_t status, const std::string &message, const char *file, int line,
                         const char *expr) {
    try {
        f();
        test_fail_at(file, line);
        printf("%s did not throw (expected status %d \"%s\")\n", expr, (int)status, message.c_str());
    } catch (const epcomm::Error &e) {
        if (e.status() == status && e.what() == message) {
            g_passed++;
            return;
        }
        test_fail_at(file, line);
        printf("%s threw status %d \"%s\", expected %d \"%s\"\n", expr, (int)e.status(), e.what(), (int)status,
               message.c_str());
    }
}

template <class F> static bool check_nothrow(F &&f, const char *file, int line, const char *stmt) {
    try {
        f();
        g_passed++;
        return true;
    } catch (const epcomm::Error &e) {
        test_fail_at(file, line);
        printf("%s threw status %d \"%s\"\n", stmt, (int)e.status(), e.what());
        return false;
    }
}

// The message of the Error `f` throws; "" when it throws none.
template <class F> static std::string error_of(F &&f) {
    try {
        f();
    } catch (const epcomm::Error &e) {
        return e.what();
    }
    return "";
}

// Prints "N passed, M failed" and returns main's exit status (a single-process test).
static inline int test_report(void) {
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}

#endif  // EPCOMM_CPP_CHECKS_HPP
