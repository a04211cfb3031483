//! Rebuilds the crate when a migration is added: `sqlx::migrate!` embeds the migrations directory,
//! and cargo does not otherwise notice a new file in it.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
