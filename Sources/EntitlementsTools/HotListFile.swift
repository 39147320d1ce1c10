import EntitlementsFormats
import Foundation

/// A hot list file for `snapshot build --hot-list`: customer ids, one per line, hottest first.
public enum HotListFile {
    public static func read(path: String) throws -> [String] {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw InputError(file: path, reason: "cannot read the file")
        }
        return String(decoding: data, as: UTF8.self).split(whereSeparator: \.isNewline).map(String.init).filter { !$0.isEmpty }
    }
}
