//! The project's only `bindgen!`: the host side of the WIT contract in `wit/`.
//!
//! Imports are plain synchronous functions, except the loader's `load`: a portable
//! get-or-set whose caller went away traps out of its call through it (contract §5.11).

wasmtime::component::bindgen!({
    path: "wit",
    world: "corral:guest/guest",
    additional_derives: [PartialEq, Eq],
    imports: {
        "corral:cache/loader.load": trappable,
    },
});
