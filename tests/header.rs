//! include/epcomm.h must be exactly what cbindgen generates from src/ffi.

#[test]
fn header_is_up_to_date() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let cfg = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        // Only src/ffi (and its submodules) forms the C API.
        .with_src(format!("{dir}/src/ffi/mod.rs"))
        .with_config(cfg)
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
