//! The project's only `bindgen!`: the host side of the WIT contract in `wit/`.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "corral:guest/guest",
    additional_derives: [PartialEq, Eq],
});
