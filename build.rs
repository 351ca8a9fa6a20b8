//! Gives the shared library its SONAME, `libepcomm.so.0.MINOR` while the version is 0.x
//! (plain `cargo build` sets none), so installed copies version correctly.

fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        let major = env!("CARGO_PKG_VERSION_MAJOR");
        let minor = env!("CARGO_PKG_VERSION_MINOR");
        let soname = if major == "0" {
            format!("libepcomm.so.0.{minor}")
        } else {
            format!("libepcomm.so.{major}")
        };
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
