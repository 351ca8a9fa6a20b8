//! Gives the shared library its SONAME, `libepcomm.so.0.MINOR` while the version is 0.x, when
//! built for installation (`make`, which sets EPCOMM_SONAME=1). Development builds keep none, so
//! programs linked against target/*/libepcomm.so in place find it by that name.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=EPCOMM_SONAME");
    let wanted = std::env::var("EPCOMM_SONAME").is_ok_and(|v| v == "1");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if wanted && target_os == "linux" {
        let major = env!("CARGO_PKG_VERSION_MAJOR");
        let minor = env!("CARGO_PKG_VERSION_MINOR");
        let soname = if major == "0" {
            format!("libepcomm.so.0.{minor}")
        } else {
            format!("libepcomm.so.{major}")
        };
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }
}
