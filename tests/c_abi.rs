//! The C ABI as C and C++ programs see it: include/epcomm.h must compile as C11 and C++17 with
//! warnings as errors, and tests/c/abi_test.c must pass against the shared library (under
//! AddressSanitizer and UBSan) and against the static library.

mod common;

use std::path::PathBuf;

use common::*;

fn abi_test_source() -> PathBuf {
    manifest_dir().join("tests/c/abi_test.c")
}

fn include_flag() -> String {
    format!("-I{}", include_dir().display())
}

/// The header alone, included first, compiles without warnings.
fn header_compiles(compiler: &str, lang_flags: &[&str], name: &str) {
    let dir = out_dir(name);
    let src = dir.join("header_only.c");
    std::fs::write(
        &src,
        "#include \"epcomm.h\"\n#include \"epcomm.h\"\nint main(void) { return EPCOMM_OK; }\n",
    )
    .expect("write header_only.c");
    let mut args: Vec<String> = lang_flags.iter().map(|s| s.to_string()).collect();
    args.extend(WARNING_FLAGS.iter().map(|s| s.to_string()));
    args.push("-pedantic".to_owned());
    args.push(include_flag());
    args.push("-c".to_owned());
    args.push(src.display().to_string());
    args.push("-o".to_owned());
    args.push(dir.join("header_only.o").display().to_string());
    compile(compiler, &args);
}

#[test]
fn header_compiles_as_c11() {
    header_compiles(&c_compiler(), &["-std=c11"], "header-c11");
}

#[test]
fn header_compiles_as_cpp17() {
    header_compiles(
        &cxx_compiler(),
        &["-x", "c++", "-std=c++17"],
        "header-cpp17",
    );
}

#[test]
fn abi_test_c11_shared_sanitized() {
    let dir = out_dir("abi-c11");
    let exe = dir.join("abi_test_c");
    build_sanitized(&c_compiler(), &["-std=c11"], &abi_test_source(), &exe);
    let out = run_sanitized(&exe);
    assert_c_test_passed("abi_test (C11, libepcomm.so, ASan+UBSan)", &out);
}

#[test]
fn abi_test_cpp17_shared_sanitized() {
    let dir = out_dir("abi-cpp17");
    let exe = dir.join("abi_test_cpp");
    build_sanitized(
        &cxx_compiler(),
        &["-x", "c++", "-std=c++17"],
        &abi_test_source(),
        &exe,
    );
    let out = run_sanitized(&exe);
    assert_c_test_passed("abi_test (C++17, libepcomm.so, ASan+UBSan)", &out);
}

#[test]
fn abi_test_c11_static() {
    let dir = out_dir("abi-static");
    let exe = dir.join("abi_test_static");
    let mut args: Vec<String> = vec!["-std=c11".to_owned()];
    args.extend(WARNING_FLAGS.iter().map(|s| s.to_string()));
    args.push(include_flag());
    args.push(abi_test_source().display().to_string());
    args.push("-o".to_owned());
    args.push(exe.display().to_string());
    args.push(staticlib().display().to_string());
    args.extend(NATIVE_STATIC_LIBS.iter().map(|s| s.to_string()));
    compile(&c_compiler(), &args);
    let out = run_plain(&exe);
    assert_c_test_passed("abi_test (C11, libepcomm.a)", &out);
}
