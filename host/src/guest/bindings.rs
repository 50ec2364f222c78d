//! The project's only `bindgen!`: the host side of the WIT contract in `wit/`. Imports
//! are plain synchronous functions.

wasmtime::component::bindgen!({
    path: "wit",
    world: "corral:guest/guest",
    additional_derives: [PartialEq, Eq],
});
