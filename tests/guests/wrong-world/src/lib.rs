//! A valid component that implements some other world, not `switchyard:policy`.

wit_bindgen::generate!({ path: "wit", world: "thing" });

struct Thing;

impl Guest for Thing {
    fn run() -> u32 {
        42
    }
}

export!(Thing);
