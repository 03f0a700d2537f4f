//! `include/pmcache.h` is what cbindgen generates from this crate: a change to the C API that
//! is not in the committed header fails here. `PMCACHE_WRITE_HEADER=1 cargo test -p
//! pmcache-capi --test header` writes it anew.

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("a UTF-8 header");
    let path = dir.join("include/pmcache.h");
    if std::env::var_os("PMCACHE_WRITE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("writing the header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} differs from what cbindgen generates from crates/capi/src: run \
         `PMCACHE_WRITE_HEADER=1 cargo test -p pmcache-capi --test header` and commit it",
        path.display()
    );
}
