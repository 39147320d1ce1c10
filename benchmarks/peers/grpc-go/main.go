// The grpc-go peer of benchmarks/run.sh: CheckEntitlements over gRPC, answered with the
// exact bytes our server sends for each customer (written by `LoadGen export-answers`),
// through a pass-through codec, so that grpc-go pays no protobuf encoding, as our cache pays
// none. What is compared is the transport: grpc-go's HTTP/2 server against ours.
//
// Built by run.sh from Debian's packages (golang-go, golang-google-grpc-dev 1.33,
// golang-github-golang-protobuf-1-5-dev) in GOPATH mode; run with GOMAXPROCS=1 on the one
// pinned core the other servers get.
//
// Usage: grpc-go-peer -answers FILE -addr 127.0.0.1:PORT
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// raw hands the message bytes through both ways: requests are read as they arrive,
// answers are sent as stored.
type raw struct{}

func (raw) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = data
	return nil
}
func (raw) String() string { return "proto" }

// answers maps a customer id to its encoded CheckEntitlementsResponse.
var answers map[string][]byte

// load reads the answers file: records of a 4-byte big-endian key length, the key, a 4-byte
// value length and the value.
func load(path string) error {
	file, err := os.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	reader := bufio.NewReaderSize(file, 1<<20)
	answers = make(map[string][]byte)
	var length [4]byte
	for {
		if _, err := io.ReadFull(reader, length[:]); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		key := make([]byte, binary.BigEndian.Uint32(length[:]))
		if _, err := io.ReadFull(reader, key); err != nil {
			return err
		}
		if _, err := io.ReadFull(reader, length[:]); err != nil {
			return err
		}
		value := make([]byte, binary.BigEndian.Uint32(length[:]))
		if _, err := io.ReadFull(reader, value); err != nil {
			return err
		}
		answers[string(key)] = value
	}
}

// userID reads field 1 (user_id, a string) of a CheckEntitlementsRequest.
func userID(request []byte) (string, bool) {
	for i := 0; i < len(request); {
		tag := request[i]
		i++
		length, n := binary.Uvarint(request[i:])
		if n <= 0 {
			return "", false
		}
		i += n
		if tag == 0x0A {
			if i+int(length) > len(request) {
				return "", false
			}
			return string(request[i : i+int(length)]), true
		}
		switch tag & 7 {
		case 0: // the varint already read was the value
		case 2:
			i += int(length)
		default:
			return "", false
		}
	}
	return "", false
}

func check(_ interface{}, _ context.Context, decode func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
	var request []byte
	if err := decode(&request); err != nil {
		return nil, err
	}
	user, ok := userID(request)
	if !ok {
		return nil, status.Error(codes.InvalidArgument, "user_id: missing")
	}
	answer, found := answers[user]
	if !found {
		empty := []byte{}
		return &empty, nil
	}
	return &answer, nil
}

func main() {
	path := flag.String("answers", "", "the answers file (LoadGen export-answers)")
	addr := flag.String("addr", "127.0.0.1:7495", "HOST:PORT to listen on")
	flag.Parse()
	if err := load(*path); err != nil {
		fmt.Fprintf(os.Stderr, "grpc-go peer: cannot read %s: %v\n", *path, err)
		os.Exit(2)
	}
	listener, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "grpc-go peer: %v\n", err)
		os.Exit(2)
	}
	// run.sh stops servers with SIGINT; a background job of a script starts with SIGINT
	// ignored, which Go keeps unless asked for it.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-stop
		os.Exit(0)
	}()
	server := grpc.NewServer(grpc.CustomCodec(raw{}))
	server.RegisterService(&grpc.ServiceDesc{
		ServiceName: "entitlements.v1.EntitlementService",
		HandlerType: (*interface{})(nil),
		Methods:     []grpc.MethodDesc{{MethodName: "CheckEntitlements", Handler: check}},
		Streams:     []grpc.StreamDesc{},
	}, struct{}{})
	fmt.Printf("grpc-go peer listening on %s with %d answers\n", listener.Addr(), len(answers))
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "grpc-go peer: %v\n", err)
		os.Exit(1)
	}
}
