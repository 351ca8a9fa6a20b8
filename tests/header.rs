//! include/epcomm.h must be exactly what cbindgen generates from src/ffi, plus
//! EPCOMM_VERSION_STRING from Cargo's version (cbindgen drops `&str` constants).

#[test]
fn header_is_up_to_date() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let cfg = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        // Only src/ffi (and its submodules) forms the C API.
        .with_src(format!("{dir}/src/ffi/mod.rs"))
        .with_config(cfg)
        .with_after_include(format!(
            "\n/**\n * The library version, \"MAJOR.MINOR.PATCH\": what epcomm_version() returns.\n */\n\
             #define EPCOMM_VERSION_STRING \"{}\"",
            env!("CARGO_PKG_VERSION")
        ))
        .generate()
        .expect("cbindgen failed")
        .write(&mut out);
    let path = format!("{dir}/include/epcomm.h");
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &out).expect("write header");
        return;
    }
    let current = std::fs::read(&path).unwrap_or_default();
    assert!(
        current == out,
        "include/epcomm.h is stale; regenerate it with: BLESS=1 cargo test --test header"
    );
}
