/// An id as a dictionary key that compares by its UTF-8 bytes, as the snapshot, the
/// cache and PostgreSQL do. A Swift `String` key compares by canonical equivalence, so
/// "Zo\u{EB}" and "Zoe\u{308}" would be one key. New ids are NFC (``IdRule``), where the
/// two agree; a store may still hold ids that are not NFC, logged before that rule, and
/// the overlay of writes must keep them apart from their NFC spelling.
struct ExactId: Hashable, Sendable {
    let string: String

    init(_ string: String) {
        self.string = string
    }

    static func == (lhs: ExactId, rhs: ExactId) -> Bool {
        lhs.string.utf8.count == rhs.string.utf8.count && lhs.string.utf8.elementsEqual(rhs.string.utf8)
    }

    func hash(into hasher: inout Hasher) {
        var string = self.string
        string.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }
}
