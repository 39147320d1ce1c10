// A grpc-go client of the gRPC door (docs/doors.md): a check, a write, a watch that sees
// the write, and the standard health check. Messages are generated from proto/ at test
// time by protoc-gen-go (Tests/doors/run.sh); the calls go through grpc-go's ClientConn
// by method name, as generated stubs do.
//
// Usage: client -addr 127.0.0.1:PORT. Exits non-zero, saying why, on the first failure.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.com/entitlementsv1"
)

const service = "/entitlements.v1.EntitlementService/"

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "go client: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	addr := flag.String("addr", "", "the door's HOST:PORT")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, *addr, grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		fail("dial %s: %v", *addr, err)
	}
	defer conn.Close()

	// A check of a customer of docs/examples, at an instant its subscription is active.
	check := &pb.CheckEntitlementsResponse{}
	err = conn.Invoke(ctx, service+"CheckEntitlements", &pb.CheckEntitlementsRequest{UserId: proto.String("user-1"), At: proto.Int64(1769904000000)}, check)
	if err != nil {
		fail("CheckEntitlements: %v", err)
	}
	if check.GetCustomerId() != "user-1" || len(check.GetEntitlements()) == 0 || !check.GetEntitlements()[0].GetIsActive() {
		fail("CheckEntitlements user-1: unexpected answer %v", check)
	}

	// A bad request: the status and message of the framed protocol.
	err = conn.Invoke(ctx, service+"CheckEntitlements", &pb.CheckEntitlementsRequest{UserId: proto.String("")}, &pb.CheckEntitlementsResponse{})
	if status.Code(err) != codes.InvalidArgument {
		fail("CheckEntitlements with an empty user id: want InvalidArgument, got %v", err)
	}

	// A watch, then a write it must see.
	user := fmt.Sprintf("go-%d", time.Now().UnixNano())
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, service+"WatchEntitlements")
	if err != nil {
		fail("WatchEntitlements: %v", err)
	}
	if err := stream.SendMsg(&pb.WatchEntitlementsRequest{UserIds: []string{user}, AfterLogSequence: proto.Int64(int64(check.GetLogSequence()))}); err != nil {
		fail("WatchEntitlements send: %v", err)
	}
	if err := stream.CloseSend(); err != nil {
		fail("WatchEntitlements close send: %v", err)
	}
	written := &pb.WriteResponse{}
	grant := &pb.GrantEntitlementRequest{UserId: proto.String(user), Grant: &pb.Grant{
		GrantId: proto.String("g-go"), EntitlementId: proto.String("premium"), GrantedDate: proto.Int64(time.Now().UnixMilli() - 1000)}}
	if err := conn.Invoke(ctx, service+"GrantEntitlement", grant, written); err != nil {
		fail("GrantEntitlement: %v", err)
	}
	if !written.GetCreated() || written.GetLogSequence() == 0 {
		fail("GrantEntitlement: unexpected answer %v", written)
	}
	event := &pb.EntitlementsChangedEvent{}
	if err := stream.RecvMsg(event); err != nil {
		fail("WatchEntitlements receive: %v", err)
	}
	if event.GetCustomerId() != user || len(event.GetCurrent().GetEntitlements()) == 0 || !event.GetCurrent().GetEntitlements()[0].GetIsActive() {
		fail("WatchEntitlements: unexpected event %v", event)
	}

	// The standard health client.
	health, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || health.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		fail("grpc.health.v1 Check: %v %v", health, err)
	}
	fmt.Println("go client: check, bad request, watch with a write, health: ok")
}
